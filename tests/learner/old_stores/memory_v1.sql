-- The memory store as loopwise wrote it before learner/records/migrations.py (commit e7e40cc; schema version 1, PRAGMA
-- user_version first, then sqlite3 iterdump), written by that commit's own store classes. tests/learner/test_migrations.py
-- opens it with today's code.
PRAGMA user_version = 1;
BEGIN TRANSACTION;
CREATE TABLE memory_versions (
            owner TEXT NOT NULL,
            scope TEXT NOT NULL,
            version INTEGER NOT NULL,
            text TEXT NOT NULL,
            created_at REAL NOT NULL,
            method TEXT NOT NULL,
            adapter TEXT,
            trajectory_id TEXT,
            turn_id TEXT,
            copilot_trajectory_id TEXT,
            copilot_turn_id TEXT,
            meta TEXT NOT NULL,
            PRIMARY KEY (owner, scope, version)
        );
INSERT INTO "memory_versions" VALUES('key-a','user:alice',1,'first note',1.79649835148196959492e+09,'memopilot','memopilot@1','traj-a','turn-2',NULL,NULL,'{"task_key": "rps"}');
INSERT INTO "memory_versions" VALUES('key-a','user:alice',2,'second note ✓',1.79649835148226952557e+09,'memopilot','memopilot@2',NULL,NULL,NULL,NULL,'{}');
INSERT INTO "memory_versions" VALUES('key-b','agent:x',1,'b''s note',1.7964983514831941128e+09,'append-all',NULL,NULL,NULL,NULL,NULL,'{}');
COMMIT;
