// The locks page: time left counts down and age counts up, from what the
// server read. The page works without this file; nothing here reaches the
// network.
"use strict";

function duration(ms) {
  if (ms < 1000) return Math.max(Math.round(ms), 0) + " ms";
  const seconds = ms / 1000;
  if (seconds < 60) return (Math.floor(seconds * 10) / 10).toFixed(1) + " s";
  const whole = Math.floor(seconds);
  const pad = (n) => String(n).padStart(2, "0");
  if (whole < 3600) return Math.floor(whole / 60) + " min " + pad(whole % 60) + " s";
  return Math.floor(whole / 3600) + " h " + pad(Math.floor((whole % 3600) / 60)) + " min";
}

function tick(loaded) {
  const passed = performance.now() - loaded;
  for (const element of document.querySelectorAll(".countdown")) {
    const left = Number(element.dataset.ms) - passed;
    if (left <= 0) {
      element.textContent = "expired";
      element.classList.add("expired");
    } else {
      element.textContent = duration(left);
    }
  }
  for (const element of document.querySelectorAll(".age")) {
    element.textContent = duration(Number(element.dataset.ms) + passed);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const loaded = performance.now();
  setInterval(() => tick(loaded), 250);
});
