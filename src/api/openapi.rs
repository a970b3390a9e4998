//! `GET /openapi.json`: the API described in OpenAPI 3.0 (kept beside the router; a test
//! checks that every route of the router is described).

use serde_json::{Value, json};

fn op(summary: &str, body: Option<&str>, ok: &str) -> Value {
    let mut o = json!({
        "summary": summary,
        "security": [{"bearer": []}],
        "responses": {
            ok: {"description": "success"},
            "401": {"description": "missing or wrong bearer token", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            "404": {"description": "no such session or job"},
            "413": {"description": "request body too large"},
        },
    });
    if let Some(schema) = body {
        o["requestBody"] = json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}});
    }
    o
}

pub fn document() -> Value {
    json!({
        "openapi": "3.0.3",
        "info": {"title": "runner", "version": env!("CARGO_PKG_VERSION"), "description": "Live sandboxes (sessions with exec, a stateful shell, persistent Python, files) and Jobs over HTTP. Every route but /healthz needs `Authorization: Bearer <token>`."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "properties": {"error": {"type": "string"}}},
                "CreateSession": {"type": "object", "required": ["environment"], "properties": {
                    "environment": {"description": "an Environment spec object, or the name of one in --env-dir"},
                    "workspace": {"type": "string"}, "staticAssets": {"type": "array"}, "mounts": {"type": "array"},
                    "backend": {"type": "string", "enum": ["containerd", "host"]}}},
                "Exec": {"type": "object", "required": ["command"], "properties": {
                    "command": {"oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}]},
                    "stdin": {"type": "string"}, "timeoutSeconds": {"type": "number"},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}}, "cwd": {"type": "string"}}},
                "Shell": {"type": "object", "required": ["command"], "properties": {
                    "command": {"type": "string"}, "timeoutSeconds": {"type": "number"},
                    "check": {"type": "string", "enum": ["ignore", "raise"]}, "name": {"type": "string"}}},
                "Python": {"type": "object", "required": ["code"], "properties": {"code": {"type": "string"}, "timeoutSeconds": {"type": "number"}}},
            },
        },
        "paths": {
            "/healthz": {"get": {"summary": "liveness (no token)", "responses": {"200": {"description": "ok"}}}},
            "/openapi.json": {"get": op("this document", None, "200")},
            "/v1/sessions": {"post": op("create a session", Some("CreateSession"), "201"), "get": op("list sessions", None, "200")},
            "/v1/sessions/{id}": {"get": op("one session", None, "200"), "delete": op("end a session and remove everything it owned", None, "204")},
            "/v1/sessions/{id}/exec": {"post": op("run a command: exitCode, stdout, stderr, timedOut, oomKilled, dropped byte counts, durationMs", Some("Exec"), "200")},
            "/v1/sessions/{id}/exec/stream": {"post": op("run a command, NDJSON events stdout/stderr/exit as they happen", Some("Exec"), "200")},
            "/v1/sessions/{id}/shell": {"post": op("stateful shell: cwd, exports and functions persist; output, exitCode, timedOut", Some("Shell"), "200")},
            "/v1/sessions/{id}/python": {"post": op("persistent Python: output, stderr, vars, error", Some("Python"), "200")},
            "/v1/sessions/{id}/python/vars": {"get": op("variables: name, type, summary", None, "200")},
            "/v1/sessions/{id}/python/vars/{name}": {"get": op("one variable's value (JSON, or a repr)", None, "200")},
            "/v1/sessions/{id}/files": {"get": op("read a workspace file (?path=)", None, "200"), "put": op("write a workspace file (?path=, raw body)", None, "204")},
            "/v1/sessions/{id}/files/list": {"get": op("list a workspace directory (?path=)", None, "200")},
            "/v1/sessions/{id}/files/upload": {"post": op("extract a tar into the workspace (?path=)", None, "204")},
            "/v1/jobs": {"post": op("submit a manifest (YAML or JSON); jobs run detached", None, "201"), "get": op("list jobs", None, "200")},
            "/v1/jobs/{name}": {"get": op("one job with its status", None, "200"), "delete": op("stop and delete a job", None, "204")},
            "/v1/jobs/{name}/logs": {"get": op("a job's stdout", None, "200")},
        },
    })
}
