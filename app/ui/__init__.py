"""The Gradio explorer: `build_ui(settings) -> gr.Blocks`.

layout.py builds the Blocks and wires events; one module per tab holds its components and its
module-level handlers (fisher, mask, train, retention, sweep, diff: the job forms, generated from
the specs by forms.py/formtab.py; jobs, result, tokens, compare, models); page.py the page-level
handlers; snippets.py and figs.py the HTML they return.
"""

from app.ui.forms import clean_spec, parse_float_list
from app.ui.forms import range_info as _range_info  # the name tests/unit/test_api.py uses
from app.ui.layout import build_ui
from app.ui.result import MAX_FIGS
from app.ui.snippets import jobs_table_html, progress_html, spec_html

__all__ = ["MAX_FIGS", "build_ui", "clean_spec", "jobs_table_html", "parse_float_list", "progress_html",
           "spec_html", "_range_info"]
