"""Who a request comes from, as the routes ask it: its tenant, and whether it may administer.

With an API keys file (`--api-keys`, kvtier.apikeys) every request but /healthz, /readyz and
/metrics must present `Authorization: Bearer <key>`; the key names the tenant, and `X-Tenant`
is ignored unless `--trust-tenant-header` (a gateway in front authenticates and names tenants).
Even then only a gateway key (`kvtier keys add NAME --gateway`) may name another tenant in it:
any other key that does gets 403, so a tenant's key never acts as another tenant.
Admin routes call `require_admin(request)`; session routes ask `session_scope(request)` which
tenant's sessions the caller may see. The file is read again on SIGHUP; a file that cannot be
used then keeps the keys already loaded.

Without a keys file the server is single-tenant and local, as it always was: no key is asked
for, `X-Tenant` names the tenant, and admin routes answer only peers on the loopback address.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

from fastapi import Request

from kvtier import apikeys
from kvtier.apikeys import KeyRing, Principal
from kvtier.errors import KeysFileError
from kvtier.server.batch.jobs import WARM_UP_TENANT
from kvtier.server.config import ServerConfig
from kvtier.server.http.common import MAX_TENANT, ApiError, check_id, local_only
from kvtier.server.warm_request import is_warm_up

log = logging.getLogger("kvtier.server")

# Answered without a key: probes and scrapers carry none (keep them off public networks).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
DEFAULT_TENANT = "default"


class Auth:
    """The loaded keys and the settings that say how requests are authenticated."""

    def __init__(self, path: Path | None, trust_tenant_header: bool = False) -> None:
        self.path = path
        self.trust_tenant_header = trust_tenant_header
        # Read at construction: a server with an unusable keys file does not start.
        self.ring: KeyRing | None = apikeys.load(path) if path is not None else None

    @classmethod
    def from_config(cls, config: ServerConfig) -> Auth:
        return cls(config.api_keys, config.trust_tenant_header)

    @property
    def enabled(self) -> bool:
        return self.ring is not None

    def describe(self) -> str:
        """One line for the start log."""
        if self.ring is None:
            return (
                "no API keys file (--api-keys): single-tenant and local; every client is "
                "trusted, X-Tenant names the tenant, admin routes answer only loopback peers"
            )
        gateways = sum(1 for r in self.ring.records if r.gateway)
        header = (
            f"X-Tenant is trusted from the {gateways} gateway key(s) (--trust-tenant-header)"
            if self.trust_tenant_header
            else "each key's tenant; X-Tenant is ignored"
        )
        return (
            f"API keys from {self.path}: {len(self.ring)} key(s) of "
            f"{len(self.ring.tenants())} tenant(s); {header}; reloaded on SIGHUP"
        )

    def reload(self) -> bool:
        """Read the keys file again; on any failure keep the keys in use and log why."""
        if self.path is None:
            return False
        try:
            ring = apikeys.load(self.path)
        except KeysFileError as exc:
            log.error("API keys not reloaded, the previous keys stay in use: %s", exc)
            return False
        except Exception:  # never let a reload take the server down
            log.exception("API keys not reloaded, the previous keys stay in use")
            return False
        self.ring = ring
        log.info("API keys reloaded from %s: %d key(s)", self.path, len(ring))
        return True

    def install_sighup(self) -> bool:
        """Reload on SIGHUP (from the running event loop's thread); False where signals cannot
        be handled (not the main thread, no SIGHUP on this platform)."""
        import asyncio

        if self.path is None:
            return False
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):
            return False
        return True

    def remove_sighup(self) -> None:
        import asyncio

        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):
            pass


def _auth(request: Request) -> Auth:
    auth: Auth = request.app.state.kvtier.auth
    return auth


def unauthorized(message: str, code: str | None) -> ApiError:
    """A 401; the connection closes after it, the request's body unread (a client without a
    key cannot hold a connection by sending its body slowly)."""
    headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
    return ApiError(401, message, "invalid_request_error", None, code, headers=headers)


async def authenticate(request: Request) -> None:
    """The app-wide dependency: with keys configured, a request without a valid key is 401
    (in OpenAI's error shape) before anything else reads it."""
    auth = _auth(request)
    if is_warm_up(request.scope):  # the server's own warm-up request, made in process
        request.state.principal = Principal(WARM_UP_TENANT, False, "warm-up")
        return
    if auth.ring is None or request.url.path in OPEN_PATHS:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'; the "
            "server's operator creates keys with `kvtier keys add`.",
            None,
        )
    principal = auth.ring.lookup(key)
    if principal is None:
        raise unauthorized(
            "Incorrect API key provided. Check the key, or ask the server's operator for a new "
            "one (`kvtier keys add`).",
            "invalid_api_key",
        )
    request.state.principal = principal


def principal(request: Request) -> Principal | None:
    """The request's principal; None without keys configured (or on an open path)."""
    found = getattr(request.state, "principal", None)
    return found if isinstance(found, Principal) else None


def _authenticated(request: Request) -> Principal:
    p = principal(request)
    if p is None:  # a route reached without the app's dependency: never let it through
        raise unauthorized("this route needs an API key", None)
    return p


def tenant_of(request: Request) -> str:
    """The tenant a generation request runs as."""
    auth = _auth(request)
    if is_warm_up(request.scope):
        return WARM_UP_TENANT
    header = request.headers.get("x-tenant")
    if auth.ring is None:
        return check_id(header or DEFAULT_TENANT, "X-Tenant", MAX_TENANT)
    p = _authenticated(request)
    if not (auth.trust_tenant_header and header) or header == p.tenant:
        return p.tenant
    if not p.gateway:  # a tenant's own key naming another tenant: never act as that tenant
        raise ApiError(
            403,
            f"this key belongs to tenant {p.tenant!r} and may not name another tenant in "
            "X-Tenant; leave the header out (the key names the tenant), or send it through the "
            "gateway, whose key the operator creates with `kvtier keys add NAME --gateway`",
            "permission_error",
            param="X-Tenant",
            code="gateway_key_required",
        )
    return check_id(header, "X-Tenant", MAX_TENANT)


def require_admin(request: Request) -> None:
    """Every admin route calls this first: with keys, an admin key whatever the peer address;
    without, a loopback peer (as before keys existed)."""
    if _auth(request).ring is None:
        local_only(request)
        return
    if not _authenticated(request).admin:
        raise ApiError(
            403,
            "this operation needs an admin key; create one with `kvtier keys add NAME --admin`",
            "permission_error",
            code="admin_key_required",
        )


def session_scope(request: Request) -> str | None:
    """The tenant whose sessions the caller may list and delete; None means every tenant's
    (an admin key, or a loopback peer without keys)."""
    if _auth(request).ring is None:
        local_only(request)
        return None
    p = _authenticated(request)
    return None if p.admin else p.tenant
