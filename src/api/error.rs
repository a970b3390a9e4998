//! The one place errors become HTTP statuses. Bodies are `{"error": "..."}`: what went wrong
//! for the caller, never internals (no paths of ours, no backtraces).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or invalid bearer token")]
    Unauthorized,
    #[error("{0}")]
    BadRequest(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("request body too large")]
    TooLarge,
    #[error("{0}")]
    Unprocessable(String),
    #[error("{0}")]
    NotSupported(String),
    /// The runner could not do its work; the detail is logged, not sent.
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    pub fn internal(e: impl std::fmt::Display) -> Self {
        ApiError::Internal(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotSupported(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Internal(detail) => {
                tracing::error!(detail, "request failed");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        let mut response = (status, Json(serde_json::json!({"error": self.to_string()}))).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}
