"""EAGLE arms: drafting in the target's feature space with a trained EAGLE head (ALGORITHMS.md §5, §7).

``chain.py`` holds :class:`EagleArm` (chains; the true-feature bookkeeping every EAGLE arm shares) and
``tree.py`` the tree arms built on it (EAGLE-2 dynamic trees, K sampled chains); this module registers the
``eagle`` spec, which picks one of them. Import order: chain ← tree ← here (no cycle).
"""
from __future__ import annotations

from typing import Annotated

from ....common.device import DTYPES
from ....common.errors import UserError
from ...heads import load_head
from ...heads.common import check_head_folder
from ....common.specs import Range
from ..base import ArmEnv, register
from .chain import EagleArm
from .tree import EagleChainsArm, EagleTreeArm

__all__ = ["EagleArm", "EagleChainsArm", "EagleTreeArm"]

TREES = ("chain", "dynamic")


@register("eagle", check=lambda typed: check_head_folder(typed["path"], expect="eagle"))
def _make(env: ArmEnv, path: str, L: Annotated[int, Range(1)] = 4, name: str | None = None,
          K: Annotated[int, Range(1)] = 1, tree: str = "chain", nodes: Annotated[int, Range(1)] = 16,
          topk: Annotated[int, Range(1)] = 4, expand: Annotated[int, Range(1)] | None = None,
          counterfactual: bool = False, dtype: str = "auto"):
    """``eagle:path=HEAD,L=4`` a chain; ``K=k``: k i.i.d. sampled chains verified together (SpecTr k-Seq);
    ``tree=dynamic,nodes=N,topk=k``: EAGLE-2's dynamic tree (decode/choose/arms/eagle/tree.py); ``expand=e``: expand
    the e best nodes per depth instead of topk (``expand=1``: the chain plus each position's runner-up tokens).
    ``counterfactual=true``: in greedy runs a chain is scored when unplayed (full-information policies and the router
    see its would-be draft every round), for L-1 head steps a round (chain.py: measured not to pay, so off).
    ``dtype=bfloat16``: the head's weights and compute in that dtype (half the bytes a draft step reads: faster on
    CPUs with native bfloat16, e.g. AVX512-BF16 or AMX; slower where it is emulated); ``auto``: the target's."""
    if tree not in TREES:
        raise UserError(f"eagle: tree must be chain (default; K=k for k sampled chains) or dynamic (EAGLE-2, "
                        f"with nodes=N,topk=k), got '{tree}'")
    if tree == "dynamic" and K > 1:
        raise UserError("eagle: K=k (sampled chains) and tree=dynamic (EAGLE-2) are two tree shapes; pick one")
    if expand is not None and tree != "dynamic":
        raise UserError(f"eagle: expand={expand} shapes a dynamic tree; add tree=dynamic (with topk=k for the "
                        f"children per node)")
    if dtype != "auto" and dtype not in DTYPES:
        raise UserError(f"eagle: dtype must be auto (the target's) or one of {', '.join(DTYPES)}, got '{dtype}'")

    def load():  # the target's shared embedding and LM head are not the head's modules: they keep their dtype
        head = load_head(path, env.target_model, expect="eagle")
        return head if dtype == "auto" else head.to(DTYPES[dtype])
    head = env.once(("eagle", path, dtype), load, path=path)
    if env.target is not None:
        env.target.want_hidden = True
        if env.target.forward_kind == "lean":  # the head's steps as the target's forwards run (decode/core/lean.py)
            head.run_lean(env.cache)
    kw = dict(generator=env.generator, label=name, target=env.target, cache=env.cache)
    if tree == "dynamic" or K > 1:
        if tree == "dynamic":
            return EagleTreeArm(head, env.target_model, env.sampling, L, nodes, topk, expand, **kw)
        return EagleChainsArm(head, env.target_model, env.sampling, L, K, **kw)
    return EagleArm(head, env.target_model, env.sampling, L, counterfactual=counterfactual, **kw)
