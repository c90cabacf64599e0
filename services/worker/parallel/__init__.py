"""What a model's modules need to run split over ranks: the collectives (``comm``), each
module's shares (``shards``) and the routed experts' token exchange under data-parallel
attention (``exchange``). The layouts themselves are ``dhisparse.family.parallel_layout``; a
group of engines stepping together is ``services.worker.rank_group``."""
