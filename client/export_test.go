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

// IdleLeases says how many leases c released through its lease table and
// keeps for a later take-back.
func IdleLeases(c *Client) int {
	t := c.table
	if t == nil {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, list := range t.idle {
		n += len(list)
	}
	return n
}
