"""One stage per process over ``torch.distributed``; :func:`init_process_group` starts a job that torchrun can
restart (see [Note: attempts] in :mod:`torchpipe.distributed.restart`)."""
from torchpipe.distributed.restart import init_process_group

__all__ = ["init_process_group"]
