package client

// PublishSources exposes publishSources to the external tests: a no-copy
// version over made-up regions (the daemon never opens them), where no GPU
// is.
var PublishSources = (*Client).publishSources

// Republished says how many no-copy versions c published as republishes.
func Republished(c *Client) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.republished
}
