//! The one place errors become HTTP statuses. Bodies are `{"error": "..."}` (with the
//! command's output for a failed `check: raise`): what went wrong for the caller, never our
//! internals (an internal failure is logged, and answered "internal error").

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::service::{Invalid, ServiceError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("request body too large")]
    TooLarge,
    /// The request could not be read (JSON, a query, UTF-8).
    #[error("{0}")]
    BadRequest(String),
    #[error("no route for {method} {path}")]
    NoRoute { method: String, path: String },
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl ApiError {
    /// The status of each kind of failure.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ApiError::Service(e) => match e {
                ServiceError::Invalid(Invalid::Rejected(_) | Invalid::Failed(_) | Invalid::CannotStart { .. }) => {
                    StatusCode::UNPROCESSABLE_ENTITY
                }
                ServiceError::Invalid(Invalid::Unsupported(_)) => StatusCode::NOT_IMPLEMENTED,
                ServiceError::Invalid(_) => StatusCode::BAD_REQUEST,
                ServiceError::NotFound { .. } => StatusCode::NOT_FOUND,
                ServiceError::Conflict(_) => StatusCode::CONFLICT,
                ServiceError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
                ServiceError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }
}

impl ApiError {
    /// The kind of failure, as the errors metric counts it.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "unauthorized",
            ApiError::TooLarge => "too_large",
            ApiError::BadRequest(_) | ApiError::Service(ServiceError::Invalid(_)) => "invalid",
            ApiError::NoRoute { .. } | ApiError::Service(ServiceError::NotFound { .. }) => "not_found",
            ApiError::Service(ServiceError::Conflict(_)) => "conflict",
            ApiError::Service(ServiceError::Unavailable { .. }) => "unavailable",
            ApiError::Service(ServiceError::Internal { .. }) => "internal",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        crate::metrics::increment("runner_errors_total", &[("kind", self.kind())]);
        let body = match &self {
            ApiError::Service(e @ ServiceError::Internal { .. }) => {
                tracing::error!(error = %e, "request failed");
                serde_json::json!({"error": "internal error"})
            }
            ApiError::Service(ServiceError::Invalid(Invalid::Failed(output))) => {
                let mut body = serde_json::to_value(output).unwrap_or_default();
                body["error"] = self.to_string().into();
                body
            }
            _ => serde_json::json!({"error": self.to_string()}),
        };
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::sessions::ShellOutput;

    async fn answer(e: ServiceError) -> (StatusCode, serde_json::Value) {
        let response = ApiError::from(e).into_response();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn every_kind_of_service_error_has_its_status_and_internals_stay_inside() {
        let cases = [
            (ServiceError::field("spec.command", "must not be empty"), 400),
            (ServiceError::rejected("setup failed"), 422),
            (
                ServiceError::Invalid(Invalid::Unsupported("no Python here".into())),
                501,
            ),
            (
                ServiceError::NotFound {
                    kind: "job",
                    name: "x".into(),
                },
                404,
            ),
            (ServiceError::Conflict("job \"x\" is running".into()), 409),
            (
                ServiceError::Unavailable {
                    what: "containerd",
                    reason: "connection refused".into(),
                },
                503,
            ),
        ];
        for (error, status) in cases {
            let message = error.to_string();
            let (got, body) = answer(error).await;
            assert_eq!(got.as_u16(), status, "{message}");
            assert_eq!(body["error"], message);
        }
        let (got, body) = answer(ServiceError::internal(
            "the job store at /var/lib/secret",
            "disk I/O error",
        ))
        .await;
        assert_eq!(got, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(body, serde_json::json!({"error": "internal error"}));
        let failed = ShellOutput {
            output: "out\n".into(),
            exit_code: Some(2),
            timed_out: false,
            output_dropped_bytes: 0,
        };
        let (got, body) = answer(ServiceError::Invalid(Invalid::Failed(Box::new(failed)))).await;
        assert_eq!(got, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            (body["output"].clone(), body["exitCode"].clone()),
            ("out\n".into(), 2.into())
        );
    }
}
