"""HAProxy's configuration for a fleet of kvtier hosts, from one template.

`haproxy.cfg.j2` (next to this module) is rendered by `kvtier fleet haproxy-config` and by the
Ansible role kvtier_host's fleet part (its `templates/haproxy.cfg.j2` is a link to this file), so
the two write the same text. The template's variables are the role's (`kvtier_host_fleet_*`);
`DEFAULTS` holds their defaults, from which the CLI's options and the role's defaults
(ops/tuning.py) are made.

Each session stays on one host: `balance hdr(X-Session-ID)` with `hash-type consistent`, so a
host that goes away gives its sessions to the others (their next turns restore from L4) and
every other session stays where it is. HAProxy asks each host's `/readyz`: a host loading,
warming up, draining (`POST /admin/drain`) or gone is taken out after `fall` checks and put
back after `rise`. A request HAProxy could not even send (the host refused the connection) is
sent to another host (`retry-on conn-failure`, `option redispatch`); one a host took and then
lost is not replayed: the client sees the failure and retries (docs/deploy.md).
"""

from __future__ import annotations

TEMPLATE = "haproxy.cfg.j2"

# Variable (without the role's `kvtier_host_fleet_` prefix) -> default. stats_bind '' is none.
DEFAULTS: dict[str, object] = {
    "bind": "*:8080",
    "check_ms": 1000,
    "fall": 2,
    "rise": 2,
    "timeout_s": 600,
    "stats_bind": "",
}


def render(hosts: list[str], **options: object) -> str:
    """The configuration text for `hosts` ("host:port" each) with `options` (names of
    `DEFAULTS`) over the defaults, rendered as Ansible's template module renders it (trim_blocks
    on, the trailing newline kept)."""
    from importlib.resources import files

    import jinja2

    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"render: unknown options {sorted(unknown)}")
    env = jinja2.Environment(
        trim_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # a configuration file, not HTML
    )
    template = env.from_string((files("kvtier") / TEMPLATE).read_text())
    values = {"hosts": hosts, **DEFAULTS, **options}
    return template.render({f"kvtier_host_fleet_{k}": v for k, v in values.items()})
