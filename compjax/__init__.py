"""compjax: communication-compressed distributed training in JAX.

Compressors are immutable values built by the factories below; each has
``compress(key, x) -> Payload``, ``decompress(payload) -> Array`` and its
theory (``unbiased``, ``omega(d)``, ``delta(d)``, ``linear``, ``bits(shape)``).
"""

from compjax.compressor import Compressor
from compjax.compressors.combinators import blockwise, chain, scaled
from compjax.compressors.dense import cast, identity
from compjax.compressors.natural import natural
from compjax.compressors.qsgd import qsgd, qsgd_omega
from compjax.compressors.sign import scaled_sign, sign
from compjax.compressors.sparse import rand_k, top_k
from compjax.compressors.terngrad import terngrad, terngrad_omega
from compjax.payload import Payload, wire_bits

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "Payload",
    "blockwise",
    "cast",
    "chain",
    "identity",
    "natural",
    "qsgd",
    "qsgd_omega",
    "rand_k",
    "scaled",
    "scaled_sign",
    "sign",
    "terngrad",
    "terngrad_omega",
    "top_k",
    "wire_bits",
]
