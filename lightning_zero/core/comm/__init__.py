"""Communication: the explicit data-parallel group and every collective the core issues, compressed ones too.

Public pieces: ``DataParallelComm`` (``data_parallel``), ``OneBitAdam`` (``onebit_adam``) with its compressed
all-reduce (``compressed_allreduce``, ``compression``), and the groups closed before exit (``process_groups``).
"""
