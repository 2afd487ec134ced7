"""Where a token's expert copies land: the expected number of distinct nodes a token's top-k experts sit on, as the
router picks them, for the node-deduplicated dispatch (DeepEP sends a token once per destination node).

Sources:
  [MCore-group] megatron/core/transformer/moe/moe_utils.py group_limited_topk: experts fall into num_groups equal
          groups; a token's groups are the group_topk with the largest sum of their top (topk / group_topk) scores;
          its topk experts are the largest scores inside those groups (DeepSeek-V3 report sec. 2.1.2 / 3.2.2,
          node-limited routing: n_group = nodes, topk_group = 4).
  [DeepEP-test] deepseek-ai/DeepEP tests/test_internode.py: rank_idx = topk_idx // (experts / ranks), rdma_idx =
          topk_idx // (experts / nodes), inplace_unique: the nodes a token is sent to are the distinct nodes of its
          experts, its own node included (num_rdma_token_sent counts them; the README's RDMA bandwidth is that
          count x hidden bytes over the kernel time).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["ROUTER_SAMPLE_TOKENS", "expected_token_nodes"]

# Tokens whose routing expected_token_nodes draws for a group-limited router: the standard error of the mean node
# count is below 0.01 node at this size (the count lies in [1, groups per token], variance < 1).
ROUTER_SAMPLE_TOKENS = 16384


def expected_token_nodes(experts: int, top_k: int, nodes: float, groups: int | None = None,
                         groups_per_token: int | None = None) -> float:
    """Expected distinct nodes (its own included) holding a token's top_k experts when the router spreads tokens
    evenly (every expert equally likely), the E experts laid E / N to a node over N nodes in expert order.

    Without group limits the top_k experts are k distinct experts drawn uniformly: a node holds none of them with
    probability C(E - E/N, k) / C(E, k) (hypergeometric), so N (1 - that) nodes are reached on average. With group
    limits [MCore-group] the expectation has no closed form (the groups are picked by their top scores' sums): it is
    the mean over ROUTER_SAMPLE_TOKENS tokens routed by the engine's algorithm on independent uniform scores (a
    fixed seed: the same value on every call)."""
    if nodes <= 1.0:
        return 1.0
    limited = groups is not None and groups_per_token is not None and groups_per_token < groups
    whole = float(nodes).is_integer() and experts % int(nodes) == 0
    if limited and whole and groups is not None and experts % groups == 0:
        return _sampled(experts, top_k, int(nodes), groups, int(groups_per_token or groups))
    per_node = experts / nodes
    miss = 1.0
    for i in range(top_k):  # C(E - E/N, k) / C(E, k) as a product of k ratios
        miss *= max(0.0, experts - per_node - i) / (experts - i)
    return nodes * (1.0 - miss)


@lru_cache(maxsize=256)
def _sampled(experts: int, top_k: int, nodes: int, groups: int, groups_per_token: int) -> float:
    """Mean distinct nodes over ROUTER_SAMPLE_TOKENS tokens routed as group_limited_topk does [MCore-group]."""
    rng = np.random.default_rng(0)
    scores = rng.random((ROUTER_SAMPLE_TOKENS, experts))
    per_group = experts // groups
    top_in_group = max(1, top_k // groups_per_token)
    grouped = np.sort(scores.reshape(ROUTER_SAMPLE_TOKENS, groups, per_group), axis=-1)
    group_scores = grouped[:, :, -top_in_group:].sum(axis=-1)
    chosen = np.argsort(-group_scores, axis=1)[:, :groups_per_token]
    allowed = np.zeros((ROUTER_SAMPLE_TOKENS, groups), dtype=bool)
    np.put_along_axis(allowed, chosen, True, axis=1)
    masked = np.where(np.repeat(allowed, per_group, axis=1), scores, -np.inf)
    picked = np.argpartition(-masked, top_k - 1, axis=1)[:, :top_k]
    node_of = picked // (experts // nodes)
    reached = np.zeros((ROUTER_SAMPLE_TOKENS, nodes), dtype=bool)
    np.put_along_axis(reached, node_of, True, axis=1)
    return float(reached.sum(axis=1).mean())
