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

/* The schema version that added streams.local_ranks (005_local_group.sql). */
#define SCHEMA_LOCAL_GROUP_VERSION 5

/* An SQL expression for the local group of the run whose id is the SQL
 * expression RUN: the distinct declarations of the streams of its latest
 * attempt, comma-joined (a range list whose union is the group; parse it
 * with ranks_parse), NULL when none declared: that daemon heard the whole
 * job. Schema SCHEMA_LOCAL_GROUP_VERSION and later. */
#define SCHEMA_RUN_LOCAL_RANKS_SQL(RUN)                                                            \
    "(SELECT group_concat(DISTINCT x.local_ranks) FROM streams x WHERE x.run_id = " RUN            \
    " AND x.attempt = (SELECT max(y.attempt) FROM streams y WHERE y.run_id = " RUN "))"

#endif
