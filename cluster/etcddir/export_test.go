package etcddir

// abandon stops renewing the lease without revoking it, as a node that
// dies does: its records vanish when the TTL runs out.
func (d *Directory) abandon() {
	d.stop()
	<-d.done
	d.mu.Lock()
	d.lease = 0
	d.mu.Unlock()
	_ = d.cli.Close()
}
