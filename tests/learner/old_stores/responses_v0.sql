-- The responses store as loopwise wrote it before learner/records/migrations.py (commit e7e40cc; no schema version yet, PRAGMA
-- user_version first, then sqlite3 iterdump), written by that commit's own store classes. tests/learner/test_migrations.py
-- opens it with today's code.
PRAGMA user_version = 0;
BEGIN TRANSACTION;
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,
    context TEXT NOT NULL
);
INSERT INTO "responses" VALUES('resp-1','key-a','sess-a',1.79649835148523306848e+09,'{"id": "resp-1", "object": "response", "loopwise": {"turn_id": "turn-2"}}','[{"id": "msg-1", "type": "message", "role": "user", "content": "q \u2713"}]');
INSERT INTO "responses" VALUES('resp-2','key-b','sess-b',1.79649835149234652514e+09,'{"id": "resp-2", "object": "response"}','[]');
CREATE INDEX responses_owner ON responses (owner, created_at);
CREATE INDEX responses_session ON responses (owner, session_id);
COMMIT;
