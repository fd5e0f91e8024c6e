"""Concrete stage services shipped with omni-mesh (the demo omni pipeline lives in ``omni_demo``)."""
