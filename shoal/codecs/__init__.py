"""How a group mean of named tensors travels: exact, cast, quantized, sparse, low-rank.

Example::

    import shoal
    model = shoal.DistributedDataParallel(model, codec=shoal.codecs.PowerSGD(rank=4))
    # or, anywhere a mean over a group is needed:
    shoal.codecs.ErrorFeedback(shoal.codecs.TopK(0.01)).mean(tensors, names, group, tag="avg")
"""

from shoal.codecs.adaptive import SizeAdaptive
from shoal.codecs.base import Codec, LossyCodec
from shoal.codecs.cast import Cast
from shoal.codecs.feedback import ErrorFeedback
from shoal.codecs.hierarchical import Hierarchical
from shoal.codecs.identity import Identity
from shoal.codecs.int8 import Int8Blockwise
from shoal.codecs.powersgd import PowerSGD
from shoal.codecs.sparse import QuantizedTopK, SparseLoCo
from shoal.codecs.topk import TopK

__all__ = [
    "Codec",
    "LossyCodec",
    "Identity",
    "Cast",
    "Int8Blockwise",
    "TopK",
    "QuantizedTopK",
    "SparseLoCo",
    "PowerSGD",
    "ErrorFeedback",
    "SizeAdaptive",
    "Hierarchical",
]
