"""compjax: communication-compressed distributed training in JAX.

Compressors are immutable values built by the factories below; each has
``compress(key, x) -> Payload``, ``decompress(payload) -> Array`` and its
theory (``unbiased``, ``omega(d)``, ``delta(d)``, ``linear``, ``bits(shape)``).
"""

from compjax import collectives, dct, exchange, hadamard, merges, nnx, sharded
from compjax.accounting import CommunicationReport, communication
from compjax.auto import Auto, AutoReport, AutoState, auto
from compjax.collectives import worker_params
from compjax.compressor import Compressor
from compjax.compressors.atomo import atomo, atomo_svd
from compjax.compressors.chunked import chunked_top_k
from compjax.compressors.combinators import blockwise, chain, scaled
from compjax.compressors.dense import cast, identity
from compjax.compressors.dithering import natural_dithering, natural_dithering_omega
from compjax.compressors.eden import drive, eden
from compjax.compressors.int_quant import (
    int_quant,
    int_quant_mean_omega,
    int_quant_omega,
    int_quant_rotated_omega,
)
from compjax.compressors.l2_sign import l2_scaled_sign
from compjax.compressors.microscaling import mx
from compjax.compressors.natural import natural
from compjax.compressors.qsgd import qsgd, qsgd_omega
from compjax.compressors.sign import scaled_sign, sign
from compjax.compressors.sparse import rand_k, top_k
from compjax.compressors.terngrad import terngrad, terngrad_omega
from compjax.dad import dad_communication, dad_grads, rank_dad_grads
from compjax.exchange import Exchange, compressed_mean, compressed_reduce_scatter, hierarchical
from compjax.local_steps import LocalSteps, local_steps
from compjax.payload import Payload, wire_bits
from compjax.sharded import FSDP, FSDPState, fsdp, fsdp_specs
from compjax.step import DataParallel, data_parallel
from compjax.transforms.base import state_specs
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

__version__ = "0.1.0"

__all__ = [
    "FSDP",
    "Auto",
    "AutoReport",
    "AutoState",
    "CommunicationReport",
    "CompressState",
    "Compressor",
    "DGCState",
    "DataParallel",
    "DeMoState",
    "DiLoCoState",
    "DianaState",
    "EF21State",
    "ErrorFeedbackState",
    "Exchange",
    "FSDPState",
    "LocalSteps",
    "OnebitAdamState",
    "Payload",
    "PowerSGDState",
    "SignVoteState",
    "StreamingDiLoCoState",
    "StromState",
    "TernGradState",
    "VarianceBasedState",
    "ZeroOneAdamLocalState",
    "ZeroOneAdamState",
    "atomo",
    "atomo_svd",
    "auto",
    "blockwise",
    "cast",
    "chain",
    "chunked_top_k",
    "collectives",
    "communication",
    "compress",
    "compressed_mean",
    "compressed_reduce_scatter",
    "dad_communication",
    "dad_grads",
    "data_parallel",
    "dct",
    "demo",
    "dgc",
    "diana",
    "diloco",
    "drive",
    "eden",
    "ef21",
    "error_feedback",
    "exchange",
    "fsdp",
    "fsdp_specs",
    "global_params",
    "hadamard",
    "hierarchical",
    "identity",
    "int_quant",
    "int_quant_mean_omega",
    "int_quant_omega",
    "int_quant_rotated_omega",
    "l2_scaled_sign",
    "local_steps",
    "merges",
    "mx",
    "natural",
    "natural_dithering",
    "natural_dithering_omega",
    "nnx",
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
    "sharded",
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
