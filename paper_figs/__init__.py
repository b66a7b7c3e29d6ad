"""The paper's figures, each a module with a ``main()`` that writes under ``paper_figs/out``.

``python -m paper_figs`` (or ``make figures``) runs them all.
"""
