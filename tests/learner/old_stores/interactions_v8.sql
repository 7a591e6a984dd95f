-- The interactions store as loopwise wrote it before learner/records/migrations.py (commit e7e40cc; schema version 8, PRAGMA
-- user_version first, then sqlite3 iterdump), written by that commit's own store classes. tests/learner/test_migrations.py
-- opens it with today's code.
PRAGMA user_version = 8;
BEGIN TRANSACTION;
CREATE TABLE experiments (
            name TEXT PRIMARY KEY,
            config TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
INSERT INTO "experiments" VALUES('f-ab','{"family":"f","arms":[{"adapter":"f@1"},{"adapter":"f@2"}]}','{"status":"running","champion":"f@1","started_at":1700000000.0}',1.79649835145478248589e+09,1.79649835145478248589e+09);
CREATE TABLE registry (kind TEXT NOT NULL CHECK (kind IN ('adapter', 'alias')), name TEXT NOT NULL,
                                  value TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (kind, name));
INSERT INTO "registry" VALUES('alias','f','{"target":"f@2"}',1.79649835145459342003e+09);
INSERT INTO "registry" VALUES('adapter','f@2','{"path":"/adapters/f/2","sha256":"ab"}',1.79649835145462799068e+09);
CREATE TABLE rewards (
            reward_id TEXT PRIMARY KEY,
            target TEXT NOT NULL CHECK (target IN ('turn', 'trajectory')),
            target_id TEXT NOT NULL,
            value REAL NOT NULL,
            source TEXT NOT NULL,
            created_at REAL NOT NULL,
            comment TEXT,
            idempotency_key TEXT
        , owner TEXT NOT NULL DEFAULT 'public');
INSERT INTO "rewards" VALUES('r1','turn','turn-2',1.0,'verifier:math',1700000010.0,NULL,'k1','key-a');
INSERT INTO "rewards" VALUES('r2','trajectory','traj-a',0.5,'feedback',1700000011.0,NULL,NULL,'key-a');
CREATE TABLE "sessions" (owner TEXT NOT NULL, session_id TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (owner, session_id));
INSERT INTO "sessions" VALUES('key-a','sess-a',1700000001.0);
CREATE TABLE trajectories (trajectory_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, created_at REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}', owner TEXT NOT NULL DEFAULT 'public');
INSERT INTO "trajectories" VALUES('traj-a','sess-a',1700000001.0,'{"agent":"svr","task_key":"t1"}','key-a');
CREATE TABLE turn_claims (turn_id TEXT PRIMARY KEY, claimed_at REAL NOT NULL);
INSERT INTO "turn_claims" VALUES('turn-1',1.79649835145468759534e+09);
CREATE TABLE turns (
            turn_id TEXT PRIMARY KEY,
            trajectory_id TEXT NOT NULL,
            session_id TEXT NOT NULL,
            idx INTEGER NOT NULL,
            parent_turn_id TEXT,
            completion_id TEXT NOT NULL,
            choice_index INTEGER NOT NULL,
            created_at REAL NOT NULL,
            model TEXT NOT NULL,
            adapter TEXT,
            context_ids BLOB NOT NULL,
            output_ids BLOB NOT NULL,
            logprobs BLOB NOT NULL,
            loss_mask BLOB NOT NULL,
            sampling TEXT NOT NULL,
            tool_calls TEXT NOT NULL,
            finish_reason TEXT NOT NULL,
            timings TEXT NOT NULL,
            messages TEXT NOT NULL,
            output_text TEXT NOT NULL,
            continuation_key TEXT NOT NULL,
            prefix_key TEXT NOT NULL
        , owner TEXT NOT NULL DEFAULT 'public', self_check TEXT);
INSERT INTO "turns" VALUES('turn-1','traj-a','sess-a',0,NULL,'cmpl-1',0,1700000001.0,'tiny','f@2',X'010000000200000004000000',X'070000000800000002000000',X'000000BF000080BE000000BE',X'010101','{"temperature":0.7}','[{"id":"c1","name":"calc","arguments":"{\"x\": 1}"}]','stop','{"queued_s":0.5,"ttft_s":0.25,"total_s":1.5}','[{"role":"user","content":"q1 ✓"}]','a1','ck1','pk1','key-a',NULL);
INSERT INTO "turns" VALUES('turn-2','traj-a','sess-a',1,'turn-1','cmpl-2',0,1700000002.0,'tiny','f@2',X'010000000200000005000000',X'070000000800000002000000',X'000000BF000080BE000000BE',X'010101','{"temperature":0.7}','[]','stop','{"queued_s":0.5,"ttft_s":0.25,"total_s":1.5}','[{"role":"user","content":"q2 ✓"}]','a2','ck2','pk2','key-a','{"format":"svr","solution":"3","verdict":null,"confidence":null,"format_ok":true,"error":null,"correct":true}');
CREATE INDEX trajectories_created ON trajectories (created_at);
CREATE INDEX turns_trajectory ON turns (trajectory_id, idx);
CREATE INDEX turns_completion ON turns (completion_id, choice_index);
CREATE INDEX turns_parent ON turns (parent_turn_id);
CREATE INDEX turns_created ON turns (created_at);
CREATE INDEX rewards_target ON rewards (target_id);
CREATE INDEX turns_adapter ON turns (adapter, created_at);
CREATE INDEX trajectories_session ON trajectories (owner, session_id);
CREATE INDEX turns_continuation ON turns (owner, session_id, continuation_key);
CREATE UNIQUE INDEX rewards_idempotency ON rewards (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX turn_claims_claimed ON turn_claims (claimed_at);
COMMIT;
