//! The OpenAPI 3.0 document, generated from the router's own route table and the JSON Schemas
//! of the request and response types: a route cannot be served undocumented, or documented
//! with a body it does not take.

use axum::http::Method;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{Value, json};

type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

fn schema_of<T: JsonSchema>(generator: &mut SchemaGenerator) -> Schema {
    generator.subschema_for::<T>()
}

/// A body: JSON of a type, or raw bytes of a content type.
#[derive(Clone, Copy)]
pub enum Body {
    Json(SchemaFn),
    Raw(&'static str),
}

/// What the document says of one route.
#[derive(Clone)]
pub struct Doc {
    pub method: Method,
    pub path: &'static str,
    pub summary: &'static str,
    pub public: bool,
    pub request: Option<Body>,
    pub status: u16,
    pub response: Option<Body>,
    /// Query parameters: name, description, required.
    pub query: Vec<(&'static str, &'static str, bool)>,
    /// Failure statuses of a route that does not answer in our error shape (a compatibility
    /// face): status, description, and the body's schema. `None`: ours (`ErrorBody`).
    pub failures: Option<(&'static [(&'static str, &'static str)], SchemaFn)>,
}

impl Doc {
    pub fn new(method: Method, path: &'static str, summary: &'static str) -> Self {
        Doc {
            method,
            path,
            summary,
            public: false,
            request: None,
            status: 200,
            response: None,
            query: Vec::new(),
            failures: None,
        }
    }

    /// Failures answered in another protocol's shape (besides our 401, which comes first).
    pub fn fails_as<T: JsonSchema>(mut self, failures: &'static [(&'static str, &'static str)]) -> Self {
        self.failures = Some((failures, schema_of::<T>));
        self
    }

    /// No token needed.
    pub fn public(mut self) -> Self {
        self.public = true;
        self
    }

    pub fn takes<T: JsonSchema>(mut self) -> Self {
        self.request = Some(Body::Json(schema_of::<T>));
        self
    }

    pub fn takes_raw(mut self, content_type: &'static str) -> Self {
        self.request = Some(Body::Raw(content_type));
        self
    }

    pub fn returns<T: JsonSchema>(mut self, status: u16) -> Self {
        self.status = status;
        self.response = Some(Body::Json(schema_of::<T>));
        self
    }

    pub fn returns_raw(mut self, status: u16, content_type: &'static str) -> Self {
        self.status = status;
        self.response = Some(Body::Raw(content_type));
        self
    }

    /// Answers with no body.
    pub fn returns_nothing(mut self, status: u16) -> Self {
        self.status = status;
        self.response = None;
        self
    }

    pub fn query(mut self, name: &'static str, description: &'static str, required: bool) -> Self {
        self.query.push((name, description, required));
        self
    }
}

fn content(body: Body, generator: &mut SchemaGenerator) -> Value {
    match body {
        Body::Json(schema) => json!({"application/json": {"schema": schema(generator)}}),
        Body::Raw(content_type) => json!({content_type: {"schema": {"type": "string", "format": "binary"}}}),
    }
}

/// The whole document for these routes.
pub fn document(routes: &[Doc]) -> Value {
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    let error = schema_of::<super::types::ErrorBody>(&mut generator);
    let mut paths = serde_json::Map::new();
    for route in routes {
        let mut responses = serde_json::Map::new();
        let mut ok = json!({"description": "success"});
        if let Some(body) = route.response {
            ok["content"] = content(body, &mut generator);
        }
        responses.insert(route.status.to_string(), ok);
        if let Some((failures, schema)) = route.failures {
            let unauthorized = json!({"description": "missing or wrong bearer token", "content": {"application/json": {"schema": error}}});
            responses.insert("401".into(), unauthorized);
            let schema = schema(&mut generator);
            for (status, description) in failures {
                responses.insert(
                    status.to_string(),
                    json!({"description": description, "content": {"application/json": {"schema": schema}}}),
                );
            }
        }
        let failures: &[(&str, &str)] = if route.public || route.failures.is_some() {
            &[]
        } else {
            &[
                ("400", "the request is wrong (the message names the field)"),
                ("401", "missing or wrong bearer token"),
                ("404", "no such session, job, file or variable"),
                ("409", "conflicts with the current state (a job of that name runs)"),
                ("413", "request body too large"),
                (
                    "422",
                    "well-formed but not doable (setup failed, a command failed under check: raise)",
                ),
                ("500", "the runner failed"),
                ("501", "the session's backend cannot do this"),
                ("503", "containerd is unreachable"),
            ]
        };
        for (status, description) in failures {
            responses.insert(
                status.to_string(),
                json!({"description": description, "content": {"application/json": {"schema": error}}}),
            );
        }
        let mut operation = json!({"summary": route.summary, "responses": responses});
        if !route.public {
            operation["security"] = json!([{"bearer": []}]);
        }
        if let Some(body) = route.request {
            operation["requestBody"] = json!({"required": true, "content": content(body, &mut generator)});
        }
        let mut parameters: Vec<Value> = path_parameters(route.path)
            .into_iter()
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        for (name, description, required) in &route.query {
            parameters.push(json!({
                "name": name, "in": "query", "required": required,
                "description": description, "schema": {"type": "string"},
            }));
        }
        if !parameters.is_empty() {
            operation["parameters"] = parameters.into();
        }
        let entry = paths.entry(route.path.to_string()).or_insert_with(|| json!({}));
        entry[route.method.as_str().to_ascii_lowercase()] = operation;
    }
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "runner",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Live sandboxes (sessions with exec, a stateful shell, persistent Python, files) and Jobs over HTTP. Every route but /healthz needs `Authorization: Bearer <token>`.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": generator.definitions().clone(),
        },
        "paths": paths,
    })
}

/// `{id}` and `{name}` of a path.
fn path_parameters(path: &str) -> Vec<&str> {
    path.split('/')
        .filter_map(|p| p.strip_prefix('{').and_then(|p| p.strip_suffix('}')))
        .collect()
}
