package ucxtransport_test

import (
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// A reader killed (SIGKILL) mid-pull leaves nothing on the holder: its pin
// goes with its etcd lease, the exposure with its control connection, and
// it never became a holder (issue 19 item 5).
func TestReaderKilledMidPull(t *testing.T) {
	requireUCX(t)
	clustertest.RequireNet(t)
	etcdtest.Require(t)
	nw := clustertest.NewNet(t)
	etcd := nw.StartEtcd()
	spawn := func(name string) *testutil.Child {
		c := testutil.SpawnWith(t, "fanout-node", testutil.SpawnOptions{SysProcAttr: clustertest.NewNetnsAttr(),
			Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=eth0", "UCX_WARN_UNUSED_ENV_VARS=n", "UCX_LOG_FILE=/dev/stderr"}})
		ip := nw.Link(c.Pid(), "20mbit") // 16 MiB take ~7 s: time to kill the reader mid-pull
		if err := c.Send(nodeCmd{Op: "start", Node: name, IP: ip, Etcd: etcd, Streams: 2}); err != nil {
			t.Fatal(err)
		}
		recv(t, c, time.Minute)
		return c
	}
	pub, reader := spawn("pub"), spawn("reader")
	const name = "ns/victim"
	if err := pub.Send(nodeCmd{Op: "put", Name: name, Size: 16 << 20, Chunk: 128 << 10}); err != nil {
		t.Fatal(err)
	}
	recv(t, pub, time.Minute)
	state := func() nodeReply {
		t.Helper()
		if err := pub.Send(nodeCmd{Op: "state", Name: name}); err != nil {
			t.Fatal(err)
		}
		return recv(t, pub, time.Minute)
	}
	if err := reader.Send(nodeCmd{Op: "pull", Name: name}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if s := state(); s.Pinned != 1 || s.Exposed != 1 {
			return fmt.Errorf("publisher: %d pins, %d exposures; want the reader's", s.Pinned, s.Exposed)
		}
		return nil
	})
	if err := syscall.Kill(reader.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	// The reader's lease has a 2 s TTL (clustertest.OpenNode).
	testutil.Eventually(t, testutil.Wait, func() error {
		if s := state(); s.Pinned != 0 || s.Exposed != 0 || !slices.Equal(s.Holders, []string{"pub"}) {
			return fmt.Errorf("publisher after the reader's death: %d pins, %d exposures, holders %v", s.Pinned, s.Exposed, s.Holders)
		}
		return nil
	})
	t.Logf("pin and exposure gone %v after the kill", time.Since(killed).Round(10*time.Millisecond))
	pub.CloseStdin()
	if err := pub.Wait(30 * time.Second); err != nil {
		t.Errorf("publisher: %v\n%s", err, pub.Stderr())
	}
}
