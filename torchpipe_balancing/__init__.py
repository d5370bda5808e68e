"""torchpipe_balancing: find a GPipe balance by profiling time or memory."""
