"""``python -m compjax.advise``: the advisor's command line (:mod:`compjax.advise.cli`)."""

from compjax.advise.cli import main

raise SystemExit(main())
