package client

// PublishSources exposes publishSources to the external tests: a no-copy
// version over made-up regions (the daemon never opens them), where no GPU
// is.
var PublishSources = (*Client).publishSources
