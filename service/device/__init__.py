"""The way to the device and back: a picture admitted, decoded, batched, scored, and its answer made.

- ``admission``: the queue bound, in one process or shared by API processes (places counted in shared memory).
- ``decoding``: pictures decoded and framed on a pool of threads, under a bound of decoded pixels in flight.
- ``device_decoding``: JPEGs decoded where the model scores them (nvJPEG on a GPU), batched.
- ``batching``: the scheduler thread that owns the device and each version's micro-batcher.
- ``answers``: a scored picture's answer: the verdict, the heat map and mask, the record's row.

May import: :mod:`padim.service.edge`, :mod:`padim.service.record`.
"""
