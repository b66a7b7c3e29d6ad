"""Small, reusable training tasks for compjax's experiments and figures.

Every dataset here ships with its package (no download at run time).
"""
