#ifndef FORESHOCK_SCHEMA_H
#define FORESHOCK_SCHEMA_H

/* Numbered SQL migrations from schema/NNN_*.sql, embedded at build time by
 * schema/embed.cmake. Migration i (1-based) brings PRAGMA user_version from
 * i-1 to i. Immutable; safe from any thread. */
struct schema_migration {
    int version;
    const char *name; /* file name, for logs */
    const char *sql;  /* NUL-terminated script */
};

extern const struct schema_migration schema_migrations[];
extern const int schema_migration_count;

#endif
