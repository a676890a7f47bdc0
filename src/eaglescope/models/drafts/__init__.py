"""Draft architectures, one small file each, behind the one draft forward (eaglescope.models.draft.Eagle3Draft)."""

from eaglescope.models.drafts.config import DRAFT_ARCHS, DraftConfig, MLASpec
from eaglescope.models.drafts.llama import Eagle3Layer


def build_layer(config: DraftConfig):
    """The draft's decoder layer for its architecture."""
    if config.arch == "mla":
        # imported here: it loads transformers' DeepSeek modeling (its rotary embedding), seconds that a Llama
        # draft never needs
        from eaglescope.models.drafts.mla import Eagle3MLALayer

        return Eagle3MLALayer(config)
    return Eagle3Layer(config)


__all__ = ["DraftConfig", "MLASpec", "DRAFT_ARCHS", "build_layer"]
