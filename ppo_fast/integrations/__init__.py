"""Drop-in integrations: ppo_fast's ops inside verl, TRL and OpenRLHF, with the peers' own signatures.

    import ppo_fast.integrations.verl as pf_verl;  pf_verl.patch()
    import ppo_fast.integrations.trl as pf_trl;    pf_trl.patch()
    import ppo_fast.integrations.openrlhf as pf_o; pf_o.patch()

Each ``patch(backend="auto")`` replaces the peer's own functions in place and returns a
handle (a context manager); the module's ``unpatch()`` restores the originals.  A peer
is imported only by its own adapter module.  ``counts()`` tells how many calls our
replacements served (and handed back to the peer, as ``name:fallback``).
See docs/integrations.md.
"""

from ._patching import COUNTS, PatchHandle, UnsupportedPeerVersion

PEERS = ("verl", "trl", "openrlhf")


def counts(peer: str | None = None) -> dict[str, int]:
    """Calls served per replaced function (``"verl.compute_value_loss": 12``), for one peer or all."""
    return {k: v for k, v in COUNTS.items() if peer is None or k.startswith(peer + ".")}


__all__ = ["PEERS", "PatchHandle", "UnsupportedPeerVersion", "counts"]
