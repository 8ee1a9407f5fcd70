"""What a training loop uses: the state API, the retry loop, the elastic sampler, DDP.

``state`` (``TorchState``, ``ObjectState``: commit, restore, sync), ``runner`` (``@le.run``),
``recovery`` (the retry engine ``@le.run`` and the Trainer's fit share), ``sampler``
(``ElasticSampler``) and ``ddp`` (``le.DistributedDataParallel``). They build on
``membership``, ``commit`` and ``durable``; none of those imports this package.
"""
