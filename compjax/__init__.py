"""compjax: communication-compressed distributed training in JAX.

Compressors are immutable values built by the factories below; each has
``compress(key, x) -> Payload``, ``decompress(payload) -> Array`` and its
theory (``unbiased``, ``omega(d)``, ``delta(d)``, ``linear``, ``bits(shape)``).

``__all__`` lists what a user calls: the compressors, the optax
transformations, the steps and the accounting.  The classes those return
(states, steps, reports) live under their modules: ``compjax.transforms.diana.DianaState``,
``compjax.steps.fsdp_state.FSDP``, ``compjax.accounting.CommunicationReport``; the
names below them stay reachable here too (``compjax.DianaState``).  The
packages: :mod:`compjax.compressors`, :mod:`compjax.exchange`,
:mod:`compjax.transforms`, :mod:`compjax.steps`, :mod:`compjax.advise`,
:mod:`compjax.dad` (``docs/development.md`` draws the layers).
"""

from compjax import _moved, collectives, dct, exchange, hadamard, merges
from compjax.accounting import CommunicationReport, communication
from compjax.compressor import Compressor
from compjax.compressors.atomo import atomo, atomo_svd
from compjax.compressors.chunked import chunked_top_k
from compjax.compressors.combinators import blockwise, chain, scaled
from compjax.compressors.dense import cast, identity
from compjax.compressors.dithering import natural_dithering, natural_dithering_omega
from compjax.compressors.eden import drive, eden
from compjax.compressors.int_quant import int_quant
from compjax.compressors.int_quant_theory import (
    int_quant_mean_omega,
    int_quant_omega,
    int_quant_rotated_omega,
)
from compjax.compressors.l2_sign import l2_scaled_sign
from compjax.compressors.microscaling import mx
from compjax.compressors.natural import natural
from compjax.compressors.qsgd import qsgd, qsgd_omega
from compjax.compressors.rand_k import rand_k
from compjax.compressors.sign import scaled_sign, sign
from compjax.compressors.sparse import top_k
from compjax.compressors.terngrad import terngrad, terngrad_omega
from compjax.dad import dad_communication, dad_grads, rank_dad_grads
from compjax.exchange import Exchange, compressed_mean, compressed_reduce_scatter, hierarchical
from compjax.payload import Payload, wire_bits
from compjax.steps import fsdp as sharded
from compjax.steps import nnx
from compjax.steps.auto import Auto, AutoReport, AutoState, auto
from compjax.steps.data_parallel import DataParallel, data_parallel
from compjax.steps.fsdp import fsdp, fsdp_specs
from compjax.steps.fsdp_state import FSDP, FSDPState
from compjax.steps.local_steps import LocalSteps, local_steps
from compjax.transforms.compress import CompressState, compress
from compjax.transforms.demo import DeMoState, demo, scale_by_demo
from compjax.transforms.dgc import DGCState, dgc
from compjax.transforms.diana import DianaState, diana
from compjax.transforms.diloco import DiLoCoState, diloco, global_params, worker_copies
from compjax.transforms.ef21 import EF21State, ef21
from compjax.transforms.error_feedback import ErrorFeedbackState, error_feedback
from compjax.transforms.onebit_adam import OnebitAdamState, onebit_adam, scale_by_onebit_adam
from compjax.transforms.padded_sparse import real_bits_sent
from compjax.transforms.powersgd import PowerSGDState, powersgd
from compjax.transforms.sign_vote import SignVoteState, sign_majority_vote
from compjax.transforms.sparseloco import sparseloco
from compjax.transforms.specs import state_specs
from compjax.transforms.streaming_diloco import StreamingDiLoCoState, streaming_diloco
from compjax.transforms.strom import StromState, strom_threshold
from compjax.transforms.terngrad_allreduce import TernGradState, terngrad_allreduce
from compjax.transforms.variance_based import VarianceBasedState, per_example_grads, variance_based
from compjax.transforms.zero_one_adam import (
    ZeroOneAdamState,
    scale_by_zero_one_adam,
    zero_one_adam,
)
from compjax.transforms.zero_one_adam_local import ZeroOneAdamLocalState
from compjax.worker_local import worker_params

_moved.install(shadowed=("compjax.auto", "compjax.local_steps"))

__version__ = "0.1.0"

#: The classes and modules reachable here but not listed in ``__all__``.
BELOW = (
    Auto,
    AutoReport,
    AutoState,
    CommunicationReport,
    CompressState,
    Compressor,
    DGCState,
    DataParallel,
    DeMoState,
    DiLoCoState,
    DianaState,
    EF21State,
    ErrorFeedbackState,
    Exchange,
    FSDP,
    FSDPState,
    LocalSteps,
    OnebitAdamState,
    Payload,
    PowerSGDState,
    SignVoteState,
    StreamingDiLoCoState,
    StromState,
    TernGradState,
    VarianceBasedState,
    ZeroOneAdamLocalState,
    ZeroOneAdamState,
    collectives,
    dct,
    exchange,
    hadamard,
    merges,
    nnx,
    sharded,
)

__all__ = [
    "atomo",
    "atomo_svd",
    "auto",
    "blockwise",
    "cast",
    "chain",
    "chunked_top_k",
    "communication",
    "compress",
    "compressed_mean",
    "compressed_reduce_scatter",
    "dad_communication",
    "dad_grads",
    "data_parallel",
    "demo",
    "dgc",
    "diana",
    "diloco",
    "drive",
    "eden",
    "ef21",
    "error_feedback",
    "fsdp",
    "fsdp_specs",
    "global_params",
    "hierarchical",
    "identity",
    "int_quant",
    "int_quant_mean_omega",
    "int_quant_omega",
    "int_quant_rotated_omega",
    "l2_scaled_sign",
    "local_steps",
    "mx",
    "natural",
    "natural_dithering",
    "natural_dithering_omega",
    "onebit_adam",
    "per_example_grads",
    "powersgd",
    "qsgd",
    "qsgd_omega",
    "rand_k",
    "rank_dad_grads",
    "real_bits_sent",
    "scale_by_demo",
    "scale_by_onebit_adam",
    "scale_by_zero_one_adam",
    "scaled",
    "scaled_sign",
    "sign",
    "sign_majority_vote",
    "sparseloco",
    "state_specs",
    "streaming_diloco",
    "strom_threshold",
    "terngrad",
    "terngrad_allreduce",
    "terngrad_omega",
    "top_k",
    "variance_based",
    "wire_bits",
    "worker_copies",
    "worker_params",
    "zero_one_adam",
]
