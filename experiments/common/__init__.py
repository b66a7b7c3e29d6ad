"""The pieces every suite shares: datasets, models, the method parser, the codec table and
timing, the benchmark language model and its compiled step, network namespaces and jobs of
processes.  A module here imports only compjax and other modules of this package."""
