/* The database lock (see dblock.h). */
#include "dblock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "fs_limits.h"

int dblock_acquire(const char *db_path, struct fs_err *err)
{
    char path[FS_CONFIG_MAX_PATH + 8];
    if ((size_t)snprintf(path, sizeof(path), "%s.lock", db_path) >= sizeof(path))
        return fs_err_set(err, -ENAMETOOLONG, "database path too long for its lock file");
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        int rc = -errno;
        return fs_err_set(err, rc, "cannot open lock file %s: %s", path, strerror(errno));
    }
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int e = errno;
        char pid[32] = "";
        ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
        pid[n > 0 ? n : 0] = '\0';
        pid[strcspn(pid, "\n")] = '\0';
        close(fd);
        if (e == EWOULDBLOCK)
            return fs_err_set(err, -EBUSY,
                              "database %s is in use by another foreshockd%s%s%s (lock %s); one "
                              "daemon per database",
                              db_path, pid[0] ? " (pid " : "", pid, pid[0] ? ")" : "", path);
        return fs_err_set(err, -e, "cannot lock %s: %s", path, strerror(e));
    }
    /* Who holds it, for the next one's message. */
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
        /* The lock holds; only the message of a second daemon loses its pid. */
    }
    return fd;
}

void dblock_release(int fd)
{
    if (fd >= 0)
        close(fd);
}
