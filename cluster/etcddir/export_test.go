package etcddir

import clientv3 "go.etcd.io/etcd/client/v3"

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

// currentLease returns the lease this node keeps its records on, 0 while it
// holds none (lost, a new one not yet granted and written).
func (d *Directory) currentLease() clientv3.LeaseID {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lease
}
