"""What every route shares: OpenAI-shaped errors and the checks of ids and peers."""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse

_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]+$")
MAX_SESSION_ID = 128
MAX_TENANT = 64
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def check_id(value: str, what: str, limit: int) -> str:
    if len(value) > limit:
        raise ApiError(
            400, f"{what} is {len(value)} characters long; use at most {limit}", param=what
        )
    if not _ID.match(value):
        raise ApiError(
            400,
            f"{what} may hold only letters, digits and . _ : @ / + = -; got {value[:40]!r}",
            param=what,
        )
    return value


def local_only(request: Request) -> None:
    host = request.client.host if request.client else ""
    if host not in LOOPBACK:
        raise ApiError(403, "admin endpoints answer only on localhost", "permission_error")
