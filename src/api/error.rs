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
                ServiceError::Invalid(Invalid::Rejected(_) | Invalid::Failed(_)) => StatusCode::UNPROCESSABLE_ENTITY,
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
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
