package client_test

// Sibling "containers" (testutil.Container): the daemon in one set of
// namespaces, clients in others, each with its own PID, mount and IPC
// namespace, private /dev/shm and /tmp, a non-root uid without
// capabilities, sharing only the socket directory. docs/containers.md.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// Uids of the two client containers; neither is root or the daemon's.
const (
	exporterUID = 10001
	readerUID   = 10002
	nobodyUID   = 65534 // the hostile-uid suites' second user
)

// ownDialRoles are roles that dial the daemon themselves (or not at all).
var ownDialRoles = map[string]func(ctx context.Context, sock string, say func(string, ...any)) error{
	// Reports what it sees of its confinement (ShmMarker: whether the
	// marker of a container started before it shows in its /dev/shm),
	// leaves its own marker, and stays until stdin closes.
	"isolation": func(ctx context.Context, sock string, say func(string, ...any)) error {
		iso, err := testutil.Observe()
		if err != nil {
			return err
		}
		if err := os.WriteFile("/dev/shm/"+testutil.ShmMarkerName, []byte("x"), 0o644); err != nil {
			return err
		}
		b, _ := json.Marshal(iso)
		say("iso %s", b)
		io.Copy(io.Discard, os.Stdin) // stay alive: the next container must not reuse our namespaces
		return nil
	},
}

// spawnIn starts role in a new sibling container c.
func spawnIn(t *testing.T, c testutil.Container, role string, env ...string) *proc {
	t.Helper()
	o, err := c.SpawnOptions(env...)
	if err != nil {
		t.Fatal(err)
	}
	return spawnAttr(t, os.Args[0], role, o.SysProcAttr, o.Env...)
}

// containers starts a daemon (root) in its own container sharing a fresh
// directory, and returns that directory's host path and the socket path
// the containers see.
func containerDaemon(t *testing.T, env ...string) (share, sock string) {
	t.Helper()
	testutil.RequireContainers(t)
	share = t.TempDir()
	sock = filepath.Join(testutil.ContainerShareDir, "store.sock")
	d := spawnIn(t, testutil.Container{Share: share}, "daemon",
		append(env, "CUDAIPC_SOCKET="+sock, fmt.Sprintf("ALLOW_UIDS=%d %d %d", exporterUID, readerUID, nobodyUID))...)
	d.waitAnswers(t, filepath.Join(share, "store.sock"))
	return share, sock
}

// The harness makes what it promises: every container is PID 1 of its
// own PID namespace, has its own IPC and mount namespaces and /dev/shm,
// runs as its non-root uid with no capability, and sees no other
// container's /dev/shm; a host object still crosses from one to the
// other through the daemon in a third.
func TestContainersIsolation(t *testing.T) {
	share, sock := containerDaemon(t, "BACKEND=host")
	self, err := testutil.Observe()
	if err != nil {
		t.Fatal(err)
	}
	var isos []testutil.Isolation
	for _, uid := range []int{exporterUID, readerUID} {
		p := spawnIn(t, testutil.Container{Share: share, UID: uid, GID: uid}, "isolation", "CUDAIPC_SOCKET="+sock)
		var iso testutil.Isolation
		if err := json.Unmarshal([]byte(p.expect("iso ")), &iso); err != nil {
			t.Fatal(err)
		}
		t.Logf("container uid %d: %+v", uid, iso)
		if iso.ShmMarker {
			t.Errorf("container uid %d sees another container's /dev/shm marker", uid)
		}
		if iso.PID != 1 || iso.UID != uid || iso.CapEff != "0000000000000000" || iso.CapPrm != "0000000000000000" {
			t.Errorf("container uid %d: pid %d uid %d CapEff %s CapPrm %s, want pid 1, uid %d, no capabilities", uid, iso.PID, iso.UID, iso.CapEff, iso.CapPrm, uid)
		}
		if iso.PIDNS == self.PIDNS || iso.IPCNS == self.IPCNS || iso.MountNS == self.MountNS || iso.ShmDevice == self.ShmDevice {
			t.Errorf("container uid %d shares a namespace or /dev/shm with the test: %+v vs %+v", uid, iso, self)
		}
		for _, o := range isos {
			if iso.PIDNS == o.PIDNS || iso.IPCNS == o.IPCNS || iso.MountNS == o.MountNS || iso.ShmDevice == o.ShmDevice {
				t.Errorf("two containers share a namespace or /dev/shm: %+v vs %+v", iso, o)
			}
		}
		isos = append(isos, iso)
	}
	if _, err := os.Stat("/dev/shm/" + testutil.ShmMarkerName); err == nil {
		t.Errorf("a container's /dev/shm marker is visible on the host")
	}

	env := []string{"CUDAIPC_SOCKET=" + sock, "NAME=iso", "SIZE=65537", "SHARED=1"}
	want := spawnIn(t, testutil.Container{Share: share, UID: exporterUID, GID: exporterUID}, "producer", env...).expect("sealed ")
	// Each uid has its own namespace: the reader names the exporter's
	// object by its owner.
	r := spawnIn(t, testutil.Container{Share: share, UID: readerUID, GID: readerUID}, "holder",
		"CUDAIPC_SOCKET="+sock, fmt.Sprintf("NAME=%d:iso", exporterUID), "SIZE=65537")
	if got := r.expect("leased "); got != want {
		t.Fatalf("reader container read %s, producer wrote %s", got, want)
	}
}
