"""Docker tool sandboxes: registry-free image, hardened containers, warm pool with leases, reaper.

    from sandbox import SandboxPool
    pool = SandboxPool(size=4); pool.start_sync()
    with pool.lease_sync() as sb:            # or: async with pool.lease() as sb: await sb.aexec(...)
        res = sb.exec("python3 -c 'print(1)'", timeout_s=10)

See docs/sandbox.md for the security model and the lease lifecycle.
"""

import importlib

# Lazy re-exports (PEP 562): `python -m sandbox.image` must not import sandbox.image twice.
_EXPORTS = {
    "ExecResult": "sandbox.container",
    "Sandbox": "sandbox.container",
    "SandboxLimits": "sandbox.container",
    "SandboxCrashed": "sandbox.errors",
    "SandboxError": "sandbox.errors",
    "SandboxUnavailable": "sandbox.errors",
    "DEFAULT_IMAGE": "sandbox.image",
    "build_image": "sandbox.image",
    "ensure_image": "sandbox.image",
    "image_exists": "sandbox.image",
    "SandboxPool": "sandbox.pool",
    "default_pool": "sandbox.pool",
    "reap": "sandbox.reaper",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")


__all__ = [
    "DEFAULT_IMAGE",
    "ExecResult",
    "Sandbox",
    "SandboxCrashed",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxUnavailable",
    "build_image",
    "default_pool",
    "ensure_image",
    "image_exists",
    "reap",
]
