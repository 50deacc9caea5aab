package cudaipc

import (
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
)

// BootID identifies one boot of one Linux machine
// (/proc/sys/kernel/random/boot_id). Two processes whose boot ids differ
// are on different machines, or on one machine across a reboot: a legacy
// IPC handle means nothing there.
type BootID [16]byte

// String formats b as the kernel does: 8-4-4-4-12 lowercase hex digits.
func (b BootID) String() string {
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// ParseBootID parses the form String prints (and the kernel writes).
func ParseBootID(s string) (BootID, error) {
	var b BootID
	if len(s) != 36 || s[8] != '-' || s[13] != '-' || s[18] != '-' || s[23] != '-' {
		return b, fmt.Errorf("cudaipc: invalid boot id %q: want xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", s)
	}
	t := s[0:8] + s[9:13] + s[14:18] + s[19:23] + s[24:36]
	if _, err := hex.Decode(b[:], []byte(t)); err != nil {
		return b, fmt.Errorf("cudaipc: invalid boot id %q: %v", s, err)
	}
	return b, nil
}

// MarshalText implements encoding.TextMarshaler.
func (b BootID) MarshalText() ([]byte, error) { return []byte(b.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler. Upper-case digits are
// accepted; String always prints lower case.
func (b *BootID) UnmarshalText(t []byte) error {
	v, err := ParseBootID(strings.ToLower(string(t)))
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// IsZero reports whether b is the zero boot id.
func (b BootID) IsZero() bool { return b == BootID{} }

// Identity is what tells whether a legacy IPC handle can work between two
// processes: the same boot of the same machine and the same PID namespace
// (the driver finds the exporter by its pid).
type Identity struct {
	PID          int    // the process id, as seen in PIDNamespace
	PIDNamespace uint64 // inode number of /proc/self/ns/pid
	BootID       BootID // /proc/sys/kernel/random/boot_id
}

var selfIdentity = sync.OnceValues(readIdentity)

// SelfIdentity returns this process's Identity, read once from /proc.
func SelfIdentity() (Identity, error) { return selfIdentity() }

func readIdentity() (Identity, error) {
	id := Identity{PID: os.Getpid()}
	link, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		return id, fmt.Errorf("cudaipc: reading the PID namespace: %w", err)
	}
	if id.PIDNamespace, err = parseNSLink(link); err != nil {
		return id, err
	}
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return id, fmt.Errorf("cudaipc: reading the boot id: %w", err)
	}
	if id.BootID, err = ParseBootID(strings.TrimSpace(string(b))); err != nil {
		return id, err
	}
	return id, nil
}

// parseNSLink parses the target of /proc/self/ns/pid, "pid:[4026531836]".
func parseNSLink(link string) (uint64, error) {
	s, ok := strings.CutPrefix(link, "pid:[")
	if ok {
		s, ok = strings.CutSuffix(s, "]")
	}
	if !ok {
		return 0, fmt.Errorf("cudaipc: unexpected /proc/self/ns/pid link %q", link)
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("cudaipc: unexpected /proc/self/ns/pid link %q", link)
	}
	return n, nil
}
