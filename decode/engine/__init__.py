"""Layer ``engine``: the round itself — ``loop`` holds ``SpecEngine`` (select → propose → score → verify →
rollback → observe, one ``step``) and ``build_engine``; ``pools`` turns arm specs and pool files into arms.
Imports ``common``, ``core`` and ``choose``."""
