"""`mmtok merge`: the finished parts of one run -> one Megatron dataset.

  merge.py     joins the parts (bytes copied, pointers rebuilt), verifies, strips reasoning on request
  assemble.py  documents of several images, assembled from the parts' items in document order
"""
