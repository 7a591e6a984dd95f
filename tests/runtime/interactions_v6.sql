-- An interaction store as loopwise wrote it before runtime/experiments_store.py took over the experiments table
-- (learner/store.py at commit a4c0436, schema version 6; sqlite3 iterdump): one turn of adapter lora-v3, a
-- verifier reward on it, a running experiment f-ab and a registry alias. tests/runtime/test_experiments_store.py
-- opens it with today's code.
BEGIN TRANSACTION;
CREATE TABLE experiments (
            name TEXT PRIMARY KEY,
            config TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
INSERT INTO "experiments" VALUES('f-ab','{"name":"f-ab","family":"f","arms":[{"adapter":"f@1","weight":1.0},{"adapter":"f@2","weight":1.0}],"sticky":"session","metric":null,"sources":"trusted","min_samples":100,"max_samples":null,"alpha":0.05,"test":"msprt","auto_promote":false,"auto_rollback":false}','{"status":"running","champion":"f@1","started_at":1700000000.0,"stopped_arms":[],"p_values":{},"decisions":[],"p_history":{}}',1.79639139870205450061e+09,1.79639139870205450061e+09);
CREATE TABLE registry (kind TEXT NOT NULL CHECK (kind IN ('adapter', 'alias')), name TEXT NOT NULL,
                                  value TEXT NOT NULL, updated_at REAL NOT NULL, PRIMARY KEY (kind, name));
INSERT INTO "registry" VALUES('alias','f','{"target":"f@1"}',1796391398.70211);
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
INSERT INTO "rewards" VALUES('r1','turn','turn-2',1.0,'verifier:exact',1700000200.0,NULL,NULL,'public');
CREATE TABLE "sessions" (owner TEXT NOT NULL, session_id TEXT NOT NULL, created_at REAL NOT NULL, PRIMARY KEY (owner, session_id));
INSERT INTO "sessions" VALUES('public','sess-a',1700000100.0);
CREATE TABLE trajectories (trajectory_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, created_at REAL NOT NULL, meta TEXT NOT NULL DEFAULT '{}', owner TEXT NOT NULL DEFAULT 'public');
INSERT INTO "trajectories" VALUES('traj-a','sess-a',1700000100.0,'{}','public');
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
        , owner TEXT NOT NULL DEFAULT 'public');
INSERT INTO "turns" VALUES('turn-2','traj-a','sess-a',0,NULL,'cmpl-2',0,1700000100.0,'tiny','lora-v3',X'B9545F7ACC5D7A6E3D695279E4D7AD6C',X'7A0E000072170000BA150000',X'86DC38C04124ADBF2318CFC0',X'010100','{"temperature":0.7,"seed":2}','[]','stop','{"queued_s":0.5,"ttft_s":0.25,"total_s":1.5}','[{"role":"user","content":"hello"}]','reply 2 ✓','','pk-2','public');
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
COMMIT;
PRAGMA user_version = 6;
