"""The kube layer: the only code in the operator that talks to the API server (see the layering contract)."""

from .client import (
    Conflict,
    Manifest,
    NotFound,
    OwnerGone,
    apply,
    delete,
    get,
    list_objects,
    patch_status,
    refusal,
    resource,
)

__all__ = [
    "Conflict",
    "Manifest",
    "NotFound",
    "OwnerGone",
    "apply",
    "delete",
    "get",
    "list_objects",
    "patch_status",
    "refusal",
    "resource",
]
