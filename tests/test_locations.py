"""Locations as IPython shows them: ``Cell In[3], line 11`` for cells, ``file.py:12`` for files."""
from __future__ import annotations

import pytest

from tensorscope._location import cell_number, format_location
from tests.helpers.kernel_utils import Kernel


def test_format_location_without_a_notebook():
    assert format_location("/home/u/proj/model.py", 12, {}) == "model.py:12"
    assert format_location("/tmp/ipykernel_42/3848307078.py", 11, {"/tmp/ipykernel_42/3848307078.py": 3}) \
        == "Cell In[3], line 11"
    assert format_location("<ipython-input-7-0123abcd>", 2, {}) == "Cell In[7], line 2"
    assert format_location(None, 5, {}) == "line 5"
    assert format_location(None, None, {}) == ""
    assert cell_number("/home/u/proj/model.py", {}) is None


@pytest.mark.kernel
def test_summary_errors_and_saved_trace_show_cell_numbers(tmp_path):
    k = Kernel(cwd=str(tmp_path))
    try:
        r = k.run("%load_ext tensorscope\nimport warnings, torch, tensorscope\nimport torch.nn.functional as F")
        assert r.status == "ok", r.error
        r = k.run("def helper(v):\n    return v.double()")
        helper_cell = r.execution_count
        save = tmp_path / "t1"
        r = k.run(f"%%tensorscope -o t --save {save}\nx = torch.randn(4, 4)\n"
                  "y = F.softmax(x)\nz = helper(x)\nw = z.float()\nkept = [x * 3]")
        assert r.status == "ok", r.error
        n = r.execution_count
        html = r.html()
        assert f"Cell In[{n}], line 3" in html            # the warning's row in the summary
        assert f"Cell In[{helper_cell}], line 2" in html   # the cast done in an earlier cell's function
        assert f"Cell In[{n}], line 6" in html            # where the tensor still alive was created
        assert "ipykernel_" not in html and ".py:" not in html.split("saved to")[0]
        # the tables keep the raw file and the cell number; the map travels with the trace
        assert k.value("set(t.ops.column('cell').to_pylist())") == {n}
        assert k.value("tensorscope.load(%r).metadata['cell_files'] == t.metadata['cell_files']" % str(save)) is True
        txt = k.value("tensorscope.load(%r).summary().to_text()" % str(save))
        assert f"Cell In[{n}], line 3" in txt
    finally:
        k.close()
