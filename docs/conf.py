"""Sphinx configuration of the compjax documentation (``make docs``)."""

import compjax

project = "compjax"
author = "the compjax authors"
copyright = "the compjax authors"
release = version = compjax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
templates_path = ["_templates"]

# Markdown: GitHub-style anchors for the headings of the guides (so that their links work on
# GitHub and in the built site alike), and dollar math off (the guides write prices in code).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The API reference: one page per public name, generated from its docstring.
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a NamedTuple's fields are documented once, as its members

html_theme = "sphinx_book_theme"
html_title = "compjax"
# The navigation sidebar is rendered on every page: kept to two levels, collapsed (it is
# most of the build's time with one page per public name).
html_theme_options = {"show_toc_level": 2, "max_navbar_depth": 2, "collapse_navbar": True}


def _types_once(app, domain, objtype, contentnode):
    """Keep each parameter's and the return value's entry in the first field list only.

    napoleon writes a docstring's sections as several field lists when another section
    stands between them (Args, then Examples, then Raises; a paragraph after Returns), and
    ``autodoc_typehints = "description"`` appends every parameter and the return type
    missing from a field list to each of them, so the later lists repeated them all (the
    pages of ``cast``, ``mx`` and ``dad_grads``).  Runs after autodoc's merge (priority 500).
    """
    from docutils import nodes

    seen = set()
    for field_list in [n for n in contentnode if isinstance(n, nodes.field_list)]:
        for field in list(field_list):
            name = field[0].astext()
            if name == "rtype" or name.startswith(("param ", "type ")):
                if name in seen:
                    field_list.remove(field)
                seen.add(name)
        if not len(field_list):
            contentnode.remove(field_list)


def setup(app):
    app.connect("object-description-transform", _types_once, priority=600)
