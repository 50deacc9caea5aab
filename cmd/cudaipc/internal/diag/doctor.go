package diag

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/seeddata"
)

// DoctorCmd checks that this machine can share GPU memory between processes
// and says what to fix when it cannot: 'cudaipc doctor'.
type DoctorCmd struct {
	JSON   bool   `help:"Print the checks as a JSON array."`
	UCXLib string `name:"ucx-lib" help:"Check this libucp.so.0 instead of the system's (as the daemon's ucx-lib setting uses it)." placeholder:"PATH"`
	// The cluster directory to check, as serve's flags name it.
	Cluster       string `help:"Check that this cluster directory answers: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS), as serve --cluster takes it." placeholder:"URL" env:"CUDAIPC_CLUSTER"`
	ClusterSecret string `name:"cluster-secret" help:"With --cluster: the cluster secret file, to verify every node and object record in etcd with it (without it the keys are only counted)." placeholder:"FILE" env:"CUDAIPC_CLUSTER_SECRET"`
	ClusterPrefix string `name:"cluster-prefix" default:"/cudaipc/v1/" help:"etcd key prefix of the cluster, as serve's (default ${default})." placeholder:"PREFIX"`
	EtcdCA        string `name:"etcd-ca" help:"CA certificate that signed etcd's (turns on TLS)." placeholder:"FILE"`
	EtcdCert      string `name:"etcd-cert" help:"Client certificate for etcd (with --etcd-key)." placeholder:"FILE"`
	EtcdKey       string `name:"etcd-key" help:"Client key for etcd." placeholder:"FILE"`
}

type check struct {
	Name   string `json:"name"`
	Status string `json:"status"` // ok, warn, fail, skip
	Detail string `json:"detail"`
	// Cluster is the "cluster records" check's finding.
	Cluster *clusterRecords `json:"cluster,omitempty"`
}

// Run runs the checks and prints them; it fails when one fails. A machine
// without the CUDA driver passes with the driver line a warning: the
// store's host backend works there, and every check that needs no driver
// runs.
func (c *DoctorCmd) Run(e *Env) error {
	var checks []check
	add := func(name, status, detail string) {
		checks = append(checks, check{Name: name, Status: status, Detail: detail})
	}

	devs, derr := cudaipc.Devices()
	switch {
	case derr != nil && errors.Is(derr, cudaipc.ErrNoDriver):
		add("driver", "warn", derr.Error()+"; without it only host-memory objects can be shared ('cudaipc serve' falls back to --backend host)")
	case derr != nil:
		add("driver", "fail", derr.Error()+": is the GPU visible to this container? see nvidia-smi")
	default:
		v, _ := cudaipc.DriverVersion()
		add("driver", "ok", fmt.Sprintf("CUDA %d.%d from %s", v/1000, v%1000/10, cudaipc.LibraryPath()))
		if len(devs) == 0 {
			add("devices", "warn", "driver loaded but no device visible (CUDA_VISIBLE_DEVICES="+os.Getenv("CUDA_VISIBLE_DEVICES")+")")
		}
		for _, d := range devs {
			st := "ok"
			var notes []string
			if !d.LegacyIPCSupported() {
				st = "fail"
				notes = append(notes, "no legacy IPC")
			}
			if !d.VMMFDSupported() {
				notes = append(notes, "no VMM POSIX-fd export (needed across PID namespaces)")
			}
			if !d.IPCEventSupported() {
				notes = append(notes, "no IPC events")
			}
			if err := d.CRC32CSupported(); err != nil {
				notes = append(notes, "cluster checksums of its objects run on the host (the daemon's CRC-32C kernel does not load: "+err.Error()+")")
			} else {
				notes = append(notes, "cluster checksums of its objects run on it (CRC-32C kernel loaded)")
			}
			detail := d.String()
			if len(notes) > 0 {
				detail += ": " + strings.Join(notes, "; ")
			}
			add(fmt.Sprintf("GPU %d", d.Ordinal()), st, detail)
		}
	}
	if v, ok := os.LookupEnv("CUDA_VISIBLE_DEVICES"); ok {
		add("CUDA_VISIBLE_DEVICES", "ok", fmt.Sprintf("%q: ordinals differ between processes; regions name GPUs by UUID", v))
	}

	gpuContainerChecks(devs, add)
	processChecks(add)

	if ns, err := os.Readlink("/proc/self/ns/pid"); err == nil {
		// As measured (docs/fd-sharing.md): legacy IPC handles open in this
		// namespace and in namespaces nested in it, not in sibling ones.
		detail := ns + ": legacy IPC reaches processes of this PID namespace and of namespaces nested in it, not of sibling namespaces (other containers); for those run 'cudaipc serve --gpu-share fd'"
		if init, err := os.Readlink("/proc/1/ns/pid"); err == nil && init != ns {
			detail += "; this process is not in the namespace of /proc/1 (a container?)"
		}
		add("pid namespace", "ok", detail)
	}

	if fd, err := unix.MemfdCreate("cudaipc-doctor", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING); err != nil {
		add("memfd", "fail", "memfd_create: "+err.Error()+": the store's host backend needs it")
	} else {
		unix.Close(fd)
		add("memfd", "ok", "memfd_create works (host-memory objects)")
	}

	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err == nil {
		if lim.Cur != unix.RLIM_INFINITY && lim.Cur < 64<<20 {
			add("memlock", "warn", fmt.Sprintf("RLIMIT_MEMLOCK is %d KiB: pinned host buffers may fail; raise it (ulimit -l)", lim.Cur>>10))
		} else {
			add("memlock", "ok", "RLIMIT_MEMLOCK "+formatLimit(lim.Cur))
		}
	}

	if derr == nil && len(devs) > 0 {
		add(ipcSelfTest(e.Ctx, devs[0]))
	} else {
		add("ipc round trip", "skip", "no GPU")
	}

	add(ucxCheck(c.UCXLib))                          // doctor_ucx.go
	checks = append(checks, etcdChecks(e.Ctx, c)...) // doctor_etcd.go
	add(storeCheck(e))

	failed := 0
	for _, ch := range checks {
		if ch.Status == "fail" {
			failed++
		}
	}
	if c.JSON {
		if err := printJSON(e.Stdout, checks); err != nil {
			return err
		}
	} else {
		for _, ch := range checks {
			fmt.Fprintf(e.Stdout, "%-4s  %-20s %s\n", ch.Status, ch.Name, ch.Detail)
		}
	}
	if failed > 0 {
		return fmt.Errorf("doctor: %d check(s) failed: fix what the lines marked fail say", failed)
	}
	return nil
}

// storeCheck says whether a store daemon answers at the socket: a socket
// file alone may be left by a daemon that died.
func storeCheck(e *Env) (string, string, string) {
	const name = "store socket"
	sock := e.socket()
	if st, err := os.Stat(sock); err != nil || st.Mode()&os.ModeSocket == 0 {
		return name, "warn", "no store daemon at " + sock + ": start one with 'cudaipc serve'"
	}
	c, err := client.DialOptions(e.Ctx, sock, client.Options{DialTimeout: 5 * time.Second})
	if err != nil {
		return name, "warn", sock + " exists but no daemon answers (" + err.Error() + "): start one with 'cudaipc serve'"
	}
	defer c.Close()
	si := c.Server()
	return name, "ok", fmt.Sprintf("a daemon answers at %s: pid %d, backend %s, protocol %d, %s", sock, si.PID, si.Backend, si.Version, si.ServerVersion)
}

func formatLimit(v uint64) string {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return strconv.FormatUint(v>>10, 10) + " KiB"
}

// ipcSelfTest exports random bytes from a helper process and maps them
// here, as two real users of CUDA IPC would.
func ipcSelfTest(ctx context.Context, dev *cudaipc.Device) (string, string, string) {
	const name = "ipc round trip"
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	h, err := startHelper(ctx, "doctor-exporter", doctorExportConfig{Device: dev.UUID()}, nil)
	if err != nil {
		return name, "fail", err.Error()
	}
	defer func() { _ = h.wait(10 * time.Second) }()
	var msg doctorExport
	if err := json.NewDecoder(h.stdout).Decode(&msg); err != nil {
		return name, "fail", "the exporter process stopped" + h.why()
	}
	if msg.Err != "" {
		return name, "fail", "exporter process: " + msg.Err
	}
	if err := dev.Synchronize(); err != nil { // create the context outside the timing
		return name, "fail", err.Error()
	}
	t0 := time.Now()
	p, err := dev.OpenMemHandle(msg.Handle, cudaipc.LazyEnablePeerAccess)
	open := time.Since(t0)
	if err != nil {
		return name, "fail", "open: " + err.Error()
	}
	defer dev.CloseMemHandle(p)
	got := make([]byte, len(msg.Data))
	if err := dev.CopyFromDevice(got, p); err != nil {
		return name, "fail", err.Error()
	}
	if !bytes.Equal(got, msg.Data) {
		return name, "fail", "the imported bytes differ from the exported ones"
	}
	return name, "ok", fmt.Sprintf("pid %d exported %d random bytes, this process read them back; open took %v", msg.Pid, len(got), open.Round(time.Microsecond))
}

type doctorExportConfig struct {
	Device cudaipc.UUID `json:"device"`
}

type doctorExport struct {
	Handle cudaipc.MemHandle `json:"handle"`
	Data   []byte            `json:"data"`
	Pid    int               `json:"pid"`
	Err    string            `json:"err,omitempty"`
}

// doctorExporter is the helper process of the doctor's IPC self-test: it
// exports 1 MiB of random bytes and holds them until its standard input
// closes.
func doctorExporter(env *Env, config []byte) error {
	enc := json.NewEncoder(env.Stdout)
	fail := func(err error) error { _ = enc.Encode(doctorExport{Err: err.Error()}); return err }
	var cfg doctorExportConfig
	if err := json.Unmarshal(config, &cfg); err != nil {
		return fail(err)
	}
	dev, err := cudaipc.DeviceByUUID(cfg.Device)
	if err != nil {
		return fail(err)
	}
	data := seeddata.Bytes(rand.Uint64(), 1<<20)
	buf, err := dev.Alloc(int64(len(data)))
	if err != nil {
		return fail(err)
	}
	defer buf.Free()
	if _, err := buf.WriteAt(data, 0); err != nil {
		return fail(err)
	}
	h, err := buf.MemHandle()
	if err != nil {
		return fail(err)
	}
	_ = enc.Encode(doctorExport{Handle: h, Data: data, Pid: os.Getpid()})
	_, _ = env.Stdin.Read(make([]byte, 1)) // hold the memory until the parent is done
	return nil
}
