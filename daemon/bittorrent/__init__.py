"""The BitTorrent layer: the libtorrent session, torrents over content-addressed blocks, the
artifacts a node seeds, bans for bad data, and the self-check of what it serves."""
