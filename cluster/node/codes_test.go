package node_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// fakeNode joins the cluster as a node that serves nothing: its control
// address refuses connections.
func fakeNode(t *testing.T, srv *etcdtest.Server, name string, sec cluster.Secret) *etcddir.Directory {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d, err := etcddir.Open(ctx, etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: name, Secret: sec, TTL: 2 * time.Second,
		CallTimeout: 5 * time.Second, Prefix: "/t/" + t.Name() + "/"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := l.Addr().String()
	l.Close()
	if err := d.Join(ctx, cluster.Node{Name: name, Control: refused}); err != nil {
		t.Fatal(err)
	}
	return d
}

// publishRecord records an object of random bytes held by d's node.
func publishRecord(t *testing.T, d *etcddir.Directory, name string) cluster.Object {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	b := make([]byte, 3<<20)
	rand.NewChaCha8([32]byte{byte(len(name)), 7}).Read(b)
	chunk := cluster.ChunkSizeFor(int64(len(b)))
	o := cluster.Object{Name: name, Owner: uint32(os.Getuid()), Size: int64(len(b)), ChunkSize: chunk,
		Sums: cluster.Checksums(b, chunk), ID: cluster.NewID()}
	if _, err := d.Publish(ctx, o); err != nil {
		t.Fatal(err)
	}
	return o
}

// TestClusterFailureCodes: each class of cluster failure reaches a client
// over the daemon's socket with its own code, for a get that does not
// wait: a record that does not verify (copied under another name, or
// written with another secret) DATA_LOSS; a record no live node holds
// NOT_FOUND; a live holder that cannot be reached, and etcd killed,
// UNAVAILABLE. Local objects stay readable throughout.
func TestClusterFailureCodes(t *testing.T) {
	srv := etcdtest.Start(t)
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	local := b.put(t, "local", 5000, client.CreateOptions{})
	prefix := "/t/" + t.Name() + "/"
	uid := uint32(os.Getuid())

	// A record no live node holds: its only holder left (lease revoked).
	ghost := fakeNode(t, srv, "ghost", secret)
	publishRecord(t, ghost, "orphan")
	ghost.Close()
	// A holder whose record is live but that refuses connections.
	mute := fakeNode(t, srv, "mute", secret)
	publishRecord(t, mute, "muted")
	// A record written with another secret.
	other, err := cluster.NewSecret([]byte("another-cluster-secret!!"))
	if err != nil {
		t.Fatal(err)
	}
	publishRecord(t, fakeNode(t, srv, "stranger", other), "strange")
	// A forged record: a genuine one copied under another name's key.
	ec, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer ec.Close()
	r, err := ec.Get(ctx, prefix+"obj/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var genuine []byte
	for _, kv := range r.Kvs {
		if strings.Contains(string(kv.Key), "/muted/") {
			genuine = kv.Value
		}
	}
	if genuine == nil {
		t.Fatalf("no record of muted among %d keys", len(r.Kvs))
	}
	if _, err := ec.Put(ctx, prefix+"obj/"+strings.Join([]string{strconv.FormatUint(uint64(uid), 10), "forged", "00000000000000000000", "00000"}, "/"), string(genuine)); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name     string
		sentinel error
		says     string
	}{
		{"forged", client.ErrDataLoss, cluster.ErrBadRecord.Error()},
		{"strange", client.ErrDataLoss, cluster.ErrBadRecord.Error()},
		{"orphan", client.ErrNotFound, cluster.ErrNoHolder.Error()},
		{"muted", client.ErrUnavailable, cluster.ErrUnreachable.Error()},
		{"nowhere", client.ErrNotFound, cluster.ErrNotFound.Error()},
	} {
		_, err := b.get(ctx, c.name)
		var ce *client.Error
		if !errors.Is(err, c.sentinel) || !errors.As(err, &ce) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("get %s: %v; want %v saying %q", c.name, err, c.sentinel, c.says)
			continue
		}
		for _, s := range []error{client.ErrDataLoss, client.ErrUnavailable, client.ErrNotFound, client.ErrInternal} {
			if s != c.sentinel && errors.Is(err, s) {
				t.Errorf("get %s: %v matches %v as well", c.name, err, s)
			}
		}
		t.Logf("get %s: %v", c.name, err)
	}

	srv.Kill()
	if _, err := b.get(ctx, "elsewhere"); !errors.Is(err, client.ErrUnavailable) || !strings.Contains(err.Error(), cluster.ErrUnavailable.Error()) {
		t.Errorf("get of a name not held here with etcd down: %v; want %v", err, client.ErrUnavailable)
	} else {
		t.Logf("get elsewhere, etcd down: %v", err)
	}
	if got, err := b.get(ctx, "local"); err != nil || string(got) != string(local) {
		t.Errorf("local get with etcd down: %v", err)
	}
}
