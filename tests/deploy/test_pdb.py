"""The router's PodDisruptionBudget, rendered by Helm."""

from __future__ import annotations

from tests.deploy.test_helm import one, render


def test_pdb_lets_drains_evict_unready_router_pods() -> None:
    pdb = one(render({}), "PodDisruptionBudget", "sr-specrouter-router")["spec"]
    # Without AlwaysAllow, a pod that never became ready still counts against
    # minAvailable and `kubectl drain` waits on it forever.
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["minAvailable"] == 1
    assert pdb["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
