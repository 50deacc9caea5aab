package etcddir

import (
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/cluster"
)

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

// holdGrants makes d's next grants of a lease wait until release is
// called (or the test ends).
func holdGrants(t testing.TB, d *Directory) (release func()) {
	ch := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	d.mu.Lock()
	d.beforeGrant = func() { <-ch }
	d.mu.Unlock()
	t.Cleanup(release)
	return release
}

// holdGuard stops d's guard from seeing changes, as if d were cut off from
// etcd, until resume is called (or the test ends).
func holdGuard(t testing.TB, d *Directory) (resume func()) {
	p := pauseReq{held: make(chan struct{}), resume: make(chan struct{})}
	d.guardPause <- p
	<-p.held
	var once sync.Once
	resume = func() { once.Do(func() { close(p.resume) }) }
	t.Cleanup(resume)
	return resume
}

// heldRecord returns the object record of ref as d guards it, nil when d
// does not guard it.
func (d *Directory) heldRecord(ref cluster.Ref) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	if h := d.held[d.k.obj(ref)]; h != nil {
		return h.val
	}
	return nil
}
