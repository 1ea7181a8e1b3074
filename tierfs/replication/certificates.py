"""The validity dates of this node's own TLS certificates (`--etcd-cert`, `--peer-cert`),
checked when they are loaded: an expired certificate (or one not valid yet) is refused at mount
with one line saying so and when, where the other end would only answer `bad certificate`."""

from __future__ import annotations

import datetime


def dates_problem(path: str, option: str,
                  now: datetime.datetime | None = None) -> str | None:
    """Why the certificate in `path` (its first, in PEM) is not valid now, for `option`; None
    if it is, or if it cannot be read here (loading it says why)."""
    # imported here: the command line imports this module (its TLS options' types) and must
    # start fast
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            certificate = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError):
        return None
    now = now or datetime.datetime.now(datetime.UTC)
    if now > certificate.not_valid_after_utc:
        return (f"{option} {path} expired on {_shown(certificate.not_valid_after_utc)}: renew "
                f"it")
    if now < certificate.not_valid_before_utc:
        return (f"{option} {path} is not valid before "
                f"{_shown(certificate.not_valid_before_utc)} (is this machine's clock right?)")
    return None


def _shown(moment: datetime.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")
