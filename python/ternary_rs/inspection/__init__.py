"""Floor 5, inspection: ``inspect`` / ``verify`` (:mod:`.report`) and ``plan`` (:mod:`.planner`) read a
checkpoint and judge it; they write nothing. (Not named ``inspect``: that is the public function
``ternary_rs.inspect``, and the standard library's module.)"""
