"""Communication: the explicit data-parallel group and every collective the core issues, compressed ones too.

Public pieces: ``DataParallelComm`` (``data_parallel``), the setup agreement, ``check_same_everywhere``,
``first_difference`` (``agreement``: the first differing entry and rank), ``OneBitAdam`` (``onebit_adam``) with its
compressed all-reduce (``compressed_allreduce``, ``compression``), the groups closed before exit
(``process_groups``), and the agreements settled before the strategy's next collective (``deferred``:
``DeferredFlags``, ``strategy_collective``).
"""

from lightning_zero.core.comm.agreement import check_same_everywhere, first_difference
from lightning_zero.core.comm.compressed_allreduce import CompressedAllReduce
from lightning_zero.core.comm.compression import Compressed, ErrorFeedback, compress
from lightning_zero.core.comm.data_parallel import DataParallelComm
from lightning_zero.core.comm.deferred import DeferredFlags, strategy_collective
from lightning_zero.core.comm.onebit_adam import OneBitAdam
from lightning_zero.core.comm.process_groups import close_all, own, reusable

__all__ = ["Compressed", "CompressedAllReduce", "DataParallelComm", "DeferredFlags", "ErrorFeedback", "OneBitAdam",
           "check_same_everywhere", "close_all", "compress", "first_difference", "own", "reusable",
           "strategy_collective"]
